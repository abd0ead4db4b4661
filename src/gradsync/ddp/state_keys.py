"""What a checkpoint holds of a wrapper: the module's keys without the prefixes wrapping adds,
and gradsync's own training state (step counter, last replica check, compression state)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gradsync.errors import ProtocolError, UsageError

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


def sync_state(wrapper: Any) -> dict[str, Any]:
    """``DistributedDataParallel.sync_state_dict()``; refuses inside a window or ``join()``."""
    if wrapper.reducer.window_forwards or wrapper._joining:
        where = "inside join()" if wrapper._joining else "inside an accumulation window"
        raise ProtocolError(
            f"a checkpoint was requested {where}: the gradients accumulated so far would "
            "be lost; save after optimizer.step(), outside join()"
        )
    state: dict[str, Any] = {
        "num_reductions": wrapper.reducer.num_reductions,
        "replicas_checked_at": wrapper._replicas_checked_at,
    }
    comm = wrapper.reducer.comm_hook.state_dict()
    if comm:
        state["comm"] = comm
    return state


def load_sync_state(wrapper: Any, state: Mapping[str, Any]) -> None:
    """``DistributedDataParallel.load_sync_state_dict()``: a collective (one small
    all-gather), so that a state one rank cannot load is refused on every rank before any
    rank has changed anything."""
    sync_state(wrapper)  # the same refusal
    problem = _comm_problem(wrapper, state)
    every = wrapper._deadline.gather_objects(problem, "the check of the loaded sync state")
    bad = [f"rank {r}: {p}" for r, p in enumerate(every) if p is not None]
    if bad:
        raise UsageError("cannot load this sync state; nothing was loaded.\n" + "\n".join(bad))
    wrapper.reducer.resume_from(int(state["num_reductions"]))
    wrapper._replicas_checked_at = int(state["replicas_checked_at"])
    if "comm" in state:
        wrapper.reducer.comm_hook.load_state_dict(state["comm"])


def _comm_problem(wrapper: Any, state: Mapping[str, Any]) -> str | None:
    """Why this rank cannot load the compression state of ``state``, or ``None``."""
    hook = wrapper.reducer.comm_hook
    keeps = bool(hook.state_dict())
    compression = f"compression={wrapper._compression_name}"
    if keeps and "comm" not in state:
        return f"it holds no compression state, and this wrapper's {compression} keeps some"
    if not keeps and "comm" in state:
        return f"it holds compression state (e.g. PowerSGD's), this wrapper has {compression}"
    return hook.load_problem(state["comm"]) if keeps else None
