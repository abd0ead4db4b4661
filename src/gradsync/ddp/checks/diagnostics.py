"""Cheap cross-rank checks that turn silent divergence into errors and warnings."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.errors import ProtocolError, ReplicaMismatchError, UsageError
from gradsync.failfast.arrivals import ArrivalRecords
from gradsync.failfast.deadline import Deadline, as_timedelta
from gradsync.mesh.dtensors import local

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the bits of ``t``: exact and independent of summation order.

    Float sums would differ between bit-identical replicas whose kernels add in another order
    (another thread count); integer addition modulo 2**64 is associative, so it cannot.
    """
    flat = local(t).detach().contiguous().view(-1)  # a DTensor: this rank's shard
    if flat.dtype == torch.bool:
        bits = flat.to(torch.int64)
    else:
        bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1021 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def check_replicas(
    named_tensors: Sequence[tuple[str, torch.Tensor]], deadline: Deadline, hint: str = ""
) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank unless every rank holds the same bits.

    One all-gather of two int64 per tensor; every rank compares the same gathered table, so all
    raise together, naming the first differing tensor and the ranks that disagree with rank 0.
    """
    if not named_tensors:
        return
    deadline.check_usable()
    mine = torch.stack([tensor_checksum(t) for _, t in named_tensors]).to(deadline.device)
    gathered = [torch.empty_like(mine) for _ in range(deadline.world_size)]
    work = dist.all_gather(gathered, mine, group=deadline.group, async_op=True)
    assert work is not None
    deadline.wait(work, "the replica check (all_gather of checksums)")
    for i, (name, _) in enumerate(named_tensors):
        differ = [
            r
            for r in range(1, deadline.world_size)
            if not torch.equal(gathered[r][i], gathered[0][i])
        ]
        if differ:
            raise ReplicaMismatchError(
                f"replicas have diverged: '{name}' on rank(s) {differ} differs from "
                f"rank 0 (seen from rank {deadline.rank}). Something changed parameters outside "
                "the synchronised step: an optimizer step on one rank only, a rank-dependent "
                f"update, or a gradient modified after synchronisation. {hint}".rstrip()
            )


def batch_fingerprint(obj: Any) -> str:
    """A hash of every tensor in a (nested) batch: enough to tell identical batches apart."""
    h = hashlib.sha1()
    for t in _tensors(obj):
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def warn_if_same_batch(batch: Any, deadline: Deadline) -> bool:
    """Warn on every rank if every rank's first batch is identical: the data is not sharded."""
    world = deadline.world_size
    if world == 1:
        return False
    prints = deadline.gather_objects(batch_fingerprint(batch), "the first-batch check")
    if prints[0] and all(p == prints[0] for p in prints):
        warnings.warn(
            f"gradsync: all {world} ranks received an identical first batch: the data is not "
            "sharded, so N ranks do the work of one. Use a DistributedSampler (and call "
            "sampler.set_epoch(epoch) every epoch).",
            stacklevel=3,
        )
        return True
    return False


def any_rank(
    flag: bool, group: dist.ProcessGroup | None = None, timeout: float | timedelta = 300.0
) -> bool:
    """True on every rank if ``flag`` is true on any rank: for decisions all ranks must share.

    Skipping a step because of a NaN loss on one rank only would leave the others waiting in
    the gradient all-reduce. Instead, every rank calls this before ``backward()``::

        if gradsync.any_rank(not torch.isfinite(loss).item()):
            optimizer.zero_grad()
            continue  # every rank skips together; parameters unchanged

    One all-reduce on ``group`` under ``timeout`` (seconds or ``timedelta``): a rank that does
    not call it makes the others raise ``CollectiveTimeoutError`` naming it.
    """
    deadline = Deadline(group, as_timedelta(timeout), ArrivalRecords(group, "any_rank"))
    deadline.begin("gradsync.any_rank")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=deadline.device)
    deadline.all_reduce(t, "gradsync.any_rank", op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_can_wrap(module: nn.Module, wrapper_type: type) -> None:
    """Refuse, before any collective, what cannot be wrapped."""
    if not dist.is_initialized():
        raise ProtocolError(
            "torch.distributed is not initialised; call "
            "dist.init_process_group(...) (torchrun sets up its environment) first"
        )
    if isinstance(module, wrapper_type):
        raise UsageError(
            "this module is already a gradsync.DistributedDataParallel; wrap the plain "
            "module once (to re-wrap after changing it, pass wrapper.module)"
        )
