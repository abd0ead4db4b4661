"""What :class:`~gradsync.recovery.Recovery` covers, refused up front with the reason."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradsync.data import GlobalBatchSampler
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import UsageError
from gradsync.optim.sharded import ShardedOptimizer


def check_covered(model: Any, optimizer: Any, sampler: Any) -> None:
    """Raise :class:`UsageError` unless a lost rank can be recovered from with these."""
    if not isinstance(model, DistributedDataParallel):
        raise UsageError("Recovery needs a gradsync.DistributedDataParallel model")
    if model.device_mesh is not None or model.process_group not in (None, dist.group.WORLD):
        raise UsageError("Recovery covers a wrapper over the default process group only")
    if isinstance(optimizer, ShardedOptimizer):
        raise UsageError(
            "Recovery does not cover ZeRO-1: the lost rank's slice of the optimizer state "
            "exists nowhere else; use a plain optimizer, or the restart path (Checkpointer)"
        )
    if model.compression is not None:
        raise UsageError("Recovery redoes steps exactly: it needs compression=None")
    if model.reduction == "mean":
        raise UsageError(
            'Recovery needs reduction="item_mean" (or "sum"): the survivors\' shares of a '
            'global batch may differ in size, and "mean" would then weigh samples unequally'
        )
    if not isinstance(sampler, GlobalBatchSampler):
        raise UsageError("Recovery needs a gradsync.data.GlobalBatchSampler")
