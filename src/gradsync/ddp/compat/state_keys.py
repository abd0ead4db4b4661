"""What a checkpoint holds of a wrapper: the module's keys without the prefixes wrapping adds,
and the checks on gradsync's own training state (step counter, last replica check,
compression state; saved and loaded by the wrapper's ``sync_state_dict``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gradsync.comm import CommHook
from gradsync.errors import ProtocolError, UsageError
from gradsync.failfast.deadline import Deadline

_PREFIXES = ("module.", "_orig_mod.")  # added by wrapping in DDP and by torch.compile


def strip_prefixes(
    state_dict: Mapping[str, Any], own_keys: Collection[str] | None = None
) -> dict[str, Any]:
    """Drop the ``module.`` / ``_orig_mod.`` prefixes that wrapping added to every key.

    A prefix is a wrapper's only if stripping it makes the keys match the module's own:
    among the dict as given and each successively stripped version, the one sharing the most
    keys with ``own_keys`` wins (the least stripped on a tie). So a model whose own child is
    called ``module`` keeps its real ``module.`` prefix, while ``module.module.`` from wrapping
    it in torch DDP loses one. Without ``own_keys``, every common prefix is stripped.
    """
    versions = [dict(state_dict)]
    while versions[-1]:
        keys = versions[-1]
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        versions.append({k[len(prefix) :]: v for k, v in keys.items()})
    if own_keys is None:
        return versions[-1]
    own = set(own_keys)
    return max(versions, key=lambda version: len(own.intersection(version)))


class RanksOutOfData(ProtocolError):
    """A checkpoint inside ``join()`` once some ranks ran out of data: raised by every rank that
    asks, all of which know it from the same handshake, so a checkpointer raises it at once
    instead of waiting for the absent ranks to agree."""


def refuse_mid_step(window_open: bool, waiting: int) -> None:
    """A checkpoint of gradsync's state is refused inside an accumulation window (the gradients
    accumulated so far would be lost) or inside ``join()`` once ``waiting`` ranks ran out of
    data (they wait in the join and take no part in a save). Between two steps of a join that
    every rank still runs, nothing is lost: the deterministic loop saves there mid-epoch."""
    if window_open:
        raise ProtocolError(
            "a checkpoint was requested inside an accumulation window: the gradients "
            "accumulated so far would be lost; save after optimizer.step()"
        )
    if waiting:
        raise RanksOutOfData(
            f"a checkpoint was requested inside join() after {waiting} rank(s) ran out of "
            "data: they wait in the join and cannot take part in a save. Save after a step "
            "every rank ran (before an epoch's short last step), or after the join"
        )


def comm_state_problem(hook: CommHook, compression: str, state: Mapping[str, Any]) -> str | None:
    """Why this rank cannot load the compression state of ``state`` (a sync state dict) into
    ``hook``, the comm hook of a wrapper with ``compression``, or ``None``."""
    keeps = bool(hook.state_dict())
    compression = f"compression={compression}"
    if keeps and "comm" not in state:
        return f"it holds no compression state, and this wrapper's {compression} keeps some"
    if not keeps and "comm" in state:
        return f"it holds compression state (e.g. PowerSGD's), this wrapper has {compression}"
    return hook.load_problem(state["comm"]) if keeps else None


def refuse_unloadable(
    hook: CommHook, compression: str, state: Mapping[str, Any], deadline: Deadline
) -> None:
    """A collective (one small all-gather): raise ``UsageError`` on every rank if any rank
    cannot load ``state``, before any rank has changed anything."""
    problem = comm_state_problem(hook, compression, state)
    every = deadline.gather_objects(problem, "the check of the loaded sync state")
    bad = [f"rank {r}: {p}" for r, p in enumerate(every) if p is not None]
    if bad:
        raise UsageError("cannot load this sync state; nothing was loaded.\n" + "\n".join(bad))
