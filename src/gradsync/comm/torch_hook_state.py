"""torch's ``PowerSGDState`` in gradsync's checkpoints.

torch's ``powerSGD_hook`` keeps its state in the ``PowerSGDState`` object, keyed by bucket
index: each bucket's error feedback (this rank's own), the P and Q of its last step (the warm
start, the same on every rank), the step count that decides when compression starts, and the
NumPy generator that seeds new Qs. torch DDP saves none of it (pytorch#75666): a job resumed
from a checkpoint restarts PowerSGD (plain all-reduces until ``start_powerSGD_iter``, fresh Qs,
no error feedback) and goes on training, but not as it would have without the stop.

gradsync's buckets keep their indices for the life of a wrapper and across a resume (the
default plan reads only parameter sizes; ``register_comm_hook`` refuses ``"auto"``), so the
state can be saved. ``sync_state_dict()`` carries it as ``torch_hook.rank<r>``, one entry per
rank (the error buffers differ), each the bytes of a ``torch.save`` of tensors and numbers only,
read back with ``weights_only=True``, and ``torch_hook.iter``, the step count shared by all
ranks; a resume then continues PowerSGD bit for bit. Other hook
states: ``None`` and process groups hold nothing; a state object of your own is yours to save.

A state object serves one wrapper: registered with a second one (a sweep that wraps a new
model and passes the old ``PowerSGDState``), its error feedback would be added to the new
model's gradients and its step count would skip the exact steps. It is recognised by the
private group it was given at its first registration, and refused on every rank.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import UsageError

_COUNTERS = (
    "iter",
    "next_stats_report",
    "total_numel_before_compression",
    "total_numel_after_compression",
)
_PER_BUCKET = ("error_dict", "p_memory_dict", "q_memory_dict")


def key(rank: int) -> str:
    return f"torch_hook.rank{rank}"


def is_powersgd(state: object) -> bool:
    """Whether ``state`` is torch's ``PowerSGDState`` (told by name: importing it would import
    NumPy, which gradsync does not otherwise need)."""
    cls = type(state)
    return cls.__name__ == "PowerSGDState" and cls.__module__.endswith(".powerSGD_hook")


def state_dict(state: Any, rank: int) -> dict[str, Any]:
    """What a checkpoint keeps of ``state`` on ``rank`` (empty: nothing to keep)."""
    if not is_powersgd(state):
        return {}
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    saved = {
        "counters": {c: int(getattr(state, c)) for c in _COUNTERS},
        "rng": (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached),
        **{
            d: {int(i): t.detach().cpu().clone() for i, t in getattr(state, d).items()}
            for d in _PER_BUCKET
        },
    }
    buf = io.BytesIO()
    torch.save(saved, buf)
    # "torch_hook.iter", the same on every rank, is what a checkpoint loaded into a wrapper
    # without this hook shows as left over (the per-rank entries belong to their ranks).
    return {"torch_hook.iter": int(state.iter), key(rank): buf.getvalue()}


def _read(saved: dict[str, Any], rank: int) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(io.BytesIO(saved[key(rank)]), weights_only=True)
    return loaded


def load_problem(saved: dict[str, Any], rank: int, bucket_numels: Sequence[int]) -> str | None:
    """Why ``saved`` cannot go into this rank's ``PowerSGDState``, or ``None``."""
    if key(rank) not in saved:
        return f"it holds no torch PowerSGDState of rank {rank}"
    try:
        loaded = _read(saved, rank)
    except Exception as exc:
        return f"its torch PowerSGDState of rank {rank} does not load ({exc})"
    for i, error in loaded["error_dict"].items():
        if not 0 <= i < len(bucket_numels) or error.numel() != bucket_numels[i]:
            where = f"{bucket_numels[i]}" if 0 <= i < len(bucket_numels) else "no such bucket"
            return (
                f"its torch PowerSGDState has an error buffer of {error.numel()} elements for "
                f"bucket {i}, this wrapper's bucket has {where}: another model or bucket plan"
            )
    return None


def load_state_dict(state: Any, saved: dict[str, Any], rank: int, device: torch.device) -> None:
    """Put what :func:`state_dict` saved back into the live ``PowerSGDState``, its tensors on
    ``device`` (where the hook computes)."""
    assert is_powersgd(state)
    loaded = _read(saved, rank)
    for counter, value in loaded["counters"].items():
        setattr(state, counter, value)
    name, keys, pos, has_gauss, cached = loaded["rng"]
    state.rng.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    for d in _PER_BUCKET:
        setattr(state, d, {i: t.to(device) for i, t in loaded[d].items()})


# The private groups given to hook states at registration (torch_hooks.adopt_private_group).
_ADOPTED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def adopted(group: dist.ProcessGroup) -> None:
    """A state's ``process_group`` was set to a wrapper's private ``group``."""
    _ADOPTED.add(group)


def refuse_reused(state: object) -> None:
    """Refuse a state that already served another wrapper (its group is that one's)."""
    group = getattr(state, "process_group", None)
    if isinstance(group, dist.ProcessGroup) and group in _ADOPTED:
        raise UsageError(
            f"this {type(state).__name__} already served another DistributedDataParallel: its "
            "error feedback and step count belong to that model and would be added to this "
            "one's gradients; create a new state object for each wrapped model"
        )
