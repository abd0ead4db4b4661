"""The step's verdicts, after each reduction: desynchronised ranks, a changed parameter set, missing
item counts, diverged replicas, parameters without gradients, NaN/Inf gradients.

Each check decides from data every rank holds identically after the bucket sums (step tags,
used flags and finite flags travel inside the buckets), so every rank reaches the same verdict
and raises the same error. Only then, to name *what* each rank held, do the ranks exchange
their local lists in one gather under the deadline: every rank is known to reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.ddp.checks.diagnostics import check_replicas
from gradsync.ddp.checks.graph_grads import ALL_REDUCE
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.checks.readout import StepReadout, unused_somewhere
from gradsync.ddp.checks.tags import (
    NO_ITEMS,
    PARAMS_CHANGED,
    RIDER,
    StepTag,
    find_desync,
    ranks_with_flag,
    updates_differ,
)
from gradsync.ddp.plan import BucketSpec
from gradsync.errors import (
    DesyncError,
    NonFiniteGradientError,
    ParametersChangedError,
    ProtocolError,
    UnusedParametersError,
)
from gradsync.failfast.deadline import Deadline


def nonfinite_params(
    specs: Sequence[BucketSpec], local_finite: Sequence[Sequence[float]], names: Sequence[str]
) -> list[str]:
    """The parameters whose local gradient held NaN or Inf before the sum mixed them
    (``local_finite``: per bucket and slot, from the step's readout; opt-in ``check_finite``)."""
    return [
        f"{names[i]} (bucket {spec.index})"
        for spec, flags in zip(specs, local_finite, strict=True)
        for i, ok in zip(spec.param_indices, flags, strict=True)
        if not ok
    ]


def per_rank_lines(mine: list[str], deadline: Deadline, what: str) -> str:
    """Every rank's ``mine`` (a collective: one gather), a line per rank that has any."""
    per_rank = deadline.gather_objects(mine, what)
    return "\n".join(f"  rank {r}: {names}" for r, names in enumerate(per_rank) if names)


@dataclass(frozen=True)
class StepContext:
    """What this rank knows of the step being judged, besides the readout."""

    deadline: Deadline
    specs: Sequence[BucketSpec]
    names: Sequence[str]  # the trainable parameters, in the reducer's order
    used: Sequence[bool]  # which got a gradient on this rank in the window
    num_active: int  # ranks that contributed data (fewer inside join())
    num_reductions: int  # synchronised steps this rank completed before this one
    loop_step: int | None  # the loop's number of this step, where a driver gives one
    watch: ParameterWatch
    changes: Sequence[str]  # how this rank's parameter set differs from wrapping time
    compare_windows: bool  # compare micro-batches per window (not with item_mean)
    find_unused_parameters: bool


def judge(readout: StepReadout, step: StepContext) -> None:
    """Raise the step's first failed verdict on every rank: desynchronised ranks, a changed
    parameter set or a missing item count (the tags), NaN/Inf gradients, then parameters
    without a gradient. Every rank reads the same ``readout``, so every rank raises the same."""
    step_tags = readout.riders.get(RIDER)  # None without buckets
    if step_tags is not None:
        check_tags(step_tags, step)
    if readout.finite is not None and not all(readout.finite):
        assert readout.local_finite is not None  # read together (check_finite)
        here = nonfinite_params(step.specs, readout.local_finite, step.names)
        raise_nonfinite([b for b, ok in enumerate(readout.finite) if not ok], here, step)
    if not step.find_unused_parameters:
        raise_if_unused(readout.counts, step)


def check_tags(tags: list[StepTag | None], step: StepContext) -> None:
    """Raise on every rank if the step tags show desynchronised ranks, a changed parameter set
    or a missing item count; confirm a difference in parameter updates with checksums."""
    deadline = step.deadline
    desync = find_desync(tags, step.num_reductions, step.compare_windows, step.loop_step)
    if desync is not None:
        raise DesyncError(f"{desync} (seen from rank {deadline.rank})")
    if ranks_with_flag(tags, PARAMS_CHANGED):
        lines = per_rank_lines(list(step.changes), deadline, "the report of changed parameters")
        raise ParametersChangedError(
            "the module's parameters changed after it was wrapped, so buckets and hooks no "
            f"longer match them (seen from rank {deadline.rank}):\n{lines}\nGradients of this "
            "step were not applied. Make such changes before wrapping, or wrap again after "
            "them on every rank: model = gradsync.DistributedDataParallel(model.module, ...)."
        )
    missing = ranks_with_flag(tags, NO_ITEMS)
    if missing:
        raise ProtocolError(
            f"reduction='item_mean', but rank(s) {missing} contributed gradients without "
            "calling count_items() in this accumulation window, so the divisor would miss "
            "their items. Call model.count_items(n) for every micro-batch on every rank "
            "(n may be 0)."
        )
    if updates_differ(tags):
        # Evidence only (see param_watch.py): confirm with exact checksums before raising.
        hint = (
            "Ranks also differ in how many in-place updates their parameters received since "
            "wrapping: look for an extra optimizer.step() or a rank-specific update."
        )
        watch = step.watch
        check_replicas(list(zip(watch.names, watch.params, strict=True)), deadline, hint)
        watch.rebase()


def raise_if_unused(counts: list[list[float]], step: StepContext) -> None:
    """Raise :class:`UnusedParametersError` on every rank if a parameter was used on fewer
    ranks than contributed (``counts``: the summed used flags, the same on every rank)."""
    if not unused_somewhere(step.specs, counts, step.num_active):
        return
    names = step.names
    unused_here = [names[i] for i in range(len(names)) if not step.used[i]]
    deadline = step.deadline
    lines = per_rank_lines(unused_here, deadline, "the report of unused parameters")
    raise UnusedParametersError(
        "these parameters received no gradient in this backward pass "
        f"(find_unused_parameters=False), seen from rank {deadline.rank}:\n{lines}\n"
        "Make every parameter take part in the loss on every rank, freeze the ones you do "
        "not train (requires_grad=False, before wrapping), or pass find_unused_parameters=True "
        "to count a missing gradient as zero."
    )


def raise_nonfinite(bad_buckets: list[int], here: list[str], step: StepContext) -> None:
    """Raise :class:`NonFiniteGradientError` on every rank; NaN/Inf survive the sum, so every
    rank sees the same ``bad_buckets`` and arrives here (``here``: this rank's parameters that
    held NaN/Inf before the sum)."""
    deadline = step.deadline
    lines = per_rank_lines(here, deadline, "the report of NaN/Inf gradients")
    where = (
        f"before communication they were in:\n{lines}"
        if lines
        else (
            "no rank had any before communication: the sum overflowed, or a value exceeded the "
            "wire format's range (fp16: +-65504)"
        )
    )
    raise NonFiniteGradientError(
        f"NaN/Inf gradients in bucket(s) {bad_buckets} (seen from rank {deadline.rank}); "
        f"{where}\nParameters are unchanged. Every rank "
        "raised this error, so catching it on every rank and calling optimizer.zero_grad() "
        "skips the step consistently."
    )


def gradient_without_forward(name: str, rank: int, through_grad: bool) -> ProtocolError:
    """A hook fired though no forward ran through the wrapper since the last reduction;
    ``through_grad``: by a backward through gradients that carry a graph."""
    if through_grad:  # see [Note: gradients with a graph] in graph_grads.py
        return ProtocolError(
            f"parameter '{name}' got a gradient on rank {rank} from a backward through "
            "gradients made with create_graph=True: gradsync synchronises one backward per "
            "forward, so this one would stay this rank's own. Take the second derivative "
            "with torch.autograd.grad(..., inputs=params): each rank gets its part; "
            f"{ALL_REDUCE}."
        )
    return ProtocolError(
        f"parameter '{name}' got a gradient on rank {rank}, but no forward ran through the "
        "DistributedDataParallel wrapper since the last synchronised backward, so this "
        "gradient would never be synchronised. Call the wrapper (not .module) for training "
        "forwards, and run a new forward before each backward."
    )


def gradient_twice(name: str) -> ProtocolError:
    return ProtocolError(
        f"parameter '{name}' produced a gradient twice in one backward pass (reentrant "
        "checkpointing?); this is not supported"
    )
