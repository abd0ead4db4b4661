"""What :class:`~gradsync.recovery.Recovery` covers, refused up front with the reason."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from gradsync.data import GlobalBatchSampler
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import UsageError
from gradsync.optim.sharded import ShardedOptimizer


def check_covered(model: Any, optimizer: Any, sampler: Any, join: str | None = None) -> None:
    """Raise :class:`UsageError` unless a lost rank can be recovered from with these (``join``:
    the store this process joins at as a replacement)."""
    if isinstance(model, FSDPModule):
        raise UsageError(
            "Recovery does not cover a fully_shard (FSDP2) model yet: losing a rank loses its "
            "shards of the parameters and optimizer state, which no survivor holds, and FSDP2's "
            "groups would have to be built again over the survivors; restart the job from its "
            "newest checkpoint (Checkpointer reshards it at the new world size)"
        )
    if not isinstance(model, DistributedDataParallel):
        raise UsageError("Recovery needs a gradsync.DistributedDataParallel model")
    mesh = model.device_mesh
    if mesh is None and model.process_group not in (None, dist.group.WORLD):
        raise UsageError(
            "Recovery covers a wrapper over the default process group or a device mesh's "
            "data-parallel axes (device_mesh=), not over a process group of its own"
        )
    if mesh is not None and (join or isinstance(optimizer, ShardedOptimizer)):
        raise UsageError(
            "Recovery over a device mesh goes on without lost replicas, but covers neither "
            "a replacement joining (it would have to join as a whole replica) nor ZeRO-1 "
            "(its slices are cut over the default group); restart the job from its newest "
            "checkpoint instead"
        )
    if isinstance(optimizer, ShardedOptimizer):
        _check_sharded(model, optimizer, join)
    if model.compression is not None:
        raise UsageError("Recovery redoes steps exactly: it needs compression=None")
    if model.reduction == "mean":
        raise UsageError(
            'Recovery needs reduction="item_mean" (or "sum"): the survivors\' shares of a '
            'global batch may differ in size, and "mean" would then weigh samples unequally'
        )
    if not isinstance(sampler, GlobalBatchSampler):
        raise UsageError("Recovery needs a gradsync.data.GlobalBatchSampler")


def _check_sharded(model: DistributedDataParallel, optimizer: ShardedOptimizer, join: Any) -> None:
    """ZeRO-1 is covered through the wrapper's sharded optimizer, whose every step runs inside
    its agreed checks ([Note: ZeRO-1 under Recovery] in ``zero.py``)."""
    sharded = model.sharded_steps
    if sharded is None or sharded.optimizer is not optimizer:
        raise UsageError(
            "Recovery covers ZeRO-1 through model.shard_optimizer(...) only: a ShardedOptimizer "
            "built on its own is stepped outside the wrapper, where no mirror of its slices "
            "is kept"
        )
    if join:
        raise UsageError(
            "a replacement cannot join a ZeRO-1 job yet (GRADSYNC_JOIN / join=): its slices "
            "would have to be cut again for one rank more; restart the job from its newest "
            "checkpoint instead"
        )
