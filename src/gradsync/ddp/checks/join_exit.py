"""What leaving ``model.join(optimizer)`` checks: a waiting rank that fell out of step, and a
collective of the loop's own that a waiting rank never issues.

[Note: what a join round cannot repeat]
A rank out of data repeats the others' steps as ``zero_grad(); <reduced gradients>; step();
zero_grad()`` (``join.py``), which is all it knows of the loop. Whatever else the loop body does
per step, an LR scheduler's ``step()``, gradient clipping, an EMA, does not run there: its
schedule lags a step per round, its parameters may differ. Leaving the join replaces the
parameters with a rank's that ran the loop, so ``check_replicas()`` sees nothing, but the
schedule and the optimizer state keep the difference and the next epoch is no longer one
process's. So every rank compares, once at the end of the join, its optimizer's
hyperparameters and a checksum of its parameters with those of a rank that ran every step,
and all warn together if a rank that stepped without data differs. Exact instead: give every
rank every step (``GlobalBatchSampler.mark_step_ends`` hands a rank with no sample a
micro-batch of none), so that nobody waits in a join round.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.ddp.checks.diagnostics import tensor_checksum
from gradsync.errors import CollectiveTimeoutError, GradsyncError, first_line
from gradsync.failfast.deadline import Deadline
from gradsync.failfast.group import is_backend_failure

# What a rank out of data records when it waits in join() (its arrival record), and the text
# of its rounds in the others' steps (``Reducer.shadow_backward``).
WAITING = "join: this rank is out of data and waits for the others"
_ROUND = "a join round ("
_EXACT = (
    "give every rank every step instead, so that none waits in join(): "
    "GlobalBatchSampler.mark_step_ends hands a rank whose share of a short last step is empty a "
    "micro-batch of no sample (docs/global-batches.md)"
)
_READ_S = 2.0  # the longest the error path waits for the store (as the roll call, liveness.py)


def foreign_collective_error(exc: BaseException, deadline: Deadline) -> GradsyncError | None:
    """The error to raise instead of ``exc``, a backend's error that left the body of
    ``model.join(optimizer)``, when a peer was out of data waiting in the join: the loop issued
    a collective of its own there, which that peer never issues. ``None``: not that case (any
    other error propagates unchanged)."""
    if isinstance(exc, GradsyncError) or not isinstance(exc, RuntimeError):
        return None
    if not is_backend_failure(exc):
        return None
    now, waiting = time.time(), []
    for rank, (_, stamp, what) in sorted(_records(deadline).items()):
        if rank != deadline.rank and what.startswith((WAITING, _ROUND)):
            what = what.replace(": gradsync: ", ": ")  # a quoted error's prefix, once is enough
            waiting.append(f"rank {rank}, last seen {now - stamp:.1f} s ago at {what}")
    if not waiting:
        return None
    cause = first_line(exc)[:300]
    return CollectiveTimeoutError(
        f"rank {deadline.rank}: a collective the training loop issued itself inside "
        f"model.join(optimizer) failed (backend: {cause}), while a rank out of data waited in "
        f"the join: {'; '.join(waiting)}. A rank out of data issues only the join's own "
        "collectives, on gradsync's private group, so a collective of the loop's own (a "
        "logging all_reduce, a barrier, a metric sync) on the ranks that still have data has "
        f"no partner there and fails. Issue it outside the join, or {_EXACT}."
    )


def _records(deadline: Deadline) -> dict[int, tuple[int, float, str]]:
    """Every rank's arrival record, or none if the store does not answer within
    ``_READ_S``: its host may be what failed, and an error path must not hang on it."""
    found: list[dict[int, tuple[int, float, str]]] = []
    reader = threading.Thread(
        target=lambda: found.append(deadline.arrivals.read()),
        name="gradsync-join-records",
        daemon=True,
    )
    reader.start()
    reader.join(_READ_S)
    return found[0] if found else {}


def warn_if_served_rounds_differ(
    deadline: Deadline,
    optimizer: torch.optim.Optimizer,
    served: int,
    params: Sequence[torch.Tensor],
) -> None:
    """At the end of a join, on every rank together: warn if a rank that stepped in ``served``
    rounds without data now differs from a rank that ran every step ([Note: what a join round
    cannot repeat]). A collective: one gather of a few bytes per rank."""
    what = "the end of join (comparing the ranks' optimizers and parameters)"
    deadline.begin(what)
    mine = (served, _hyperparameters(optimizer), _digest(params))
    table = deadline.gather_objects(mine, what)
    steady = [r for r, row in enumerate(table) if row[0] == 0]
    if not steady or len(steady) == len(table):  # nobody stepped without data
        return
    ref, lines = steady[0], []
    for rank, (rounds, hyper, digest) in enumerate(table):
        if rounds == 0:
            continue
        found = _differences(hyper, table[ref][1], ref)
        if digest != table[ref][2]:
            found.append(f"its parameters differ from rank {ref}'s")
        if found:
            lines.append(
                f"rank {rank}, which ran {rounds} of the others' steps as optimizer.step() "
                f"alone: {', '.join(found)}"
            )
    if lines:
        warnings.warn(
            f"gradsync: join() was not exact: {'; '.join(lines)}. The loop does more per step "
            "than optimizer.step() (an LR scheduler, gradient clipping) and that did not run on "
            "the ranks out of data; their parameters are replaced now, but their schedule and "
            f"optimizer state keep the difference, so training is no longer one process's. To "
            f"be exact, {_EXACT}.",
            stacklevel=4,
        )


def _plain(value: Any) -> Any:
    """A hyperparameter as plain data to compare, or ``None`` for what is not compared."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
        return tuple(value)
    return None


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", [])
    plain = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in groups]
    return [{k: v for k, v in g.items() if v is not None} for g in plain]


def _digest(params: Sequence[torch.Tensor]) -> str:
    """A short hash of the parameters' bits (exact, ``tensor_checksum``)."""
    if not params:
        return ""
    sums = torch.stack([tensor_checksum(p) for p in params]).cpu()
    return hashlib.sha256(sums.numpy().tobytes()).hexdigest()[:16]


def _differences(mine: list[dict[str, Any]], ref: list[dict[str, Any]], ref_rank: int) -> list[str]:
    found = []
    for i, (a, b) in enumerate(zip(mine, ref, strict=False)):
        for key in sorted(a.keys() | b.keys()):
            if repr(a.get(key)) != repr(b.get(key)):
                found.append(
                    f"its param group {i}'s {key} is {a.get(key)!r}, rank {ref_rank}'s "
                    f"{b.get(key)!r}"
                )
    return found
