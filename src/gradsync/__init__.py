"""gradsync: data-parallel training on torch.distributed that equals one-device training."""

from gradsync.ddp.checks.diagnostics import any_rank
from gradsync.ddp.naive import average_gradients
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    DesyncError,
    GradsyncError,
    ModelMismatchError,
    NonFiniteGradientError,
    ParametersChangedError,
    ProtocolError,
    ReplicaMismatchError,
    UnusedParametersError,
    UsageError,
)
from gradsync.optim import ShardedOptimizer, clip_grad_norm_

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveTimeoutError",
    "DesyncError",
    "DistributedDataParallel",
    "GradsyncError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "ParametersChangedError",
    "ProtocolError",
    "ReplicaMismatchError",
    "ShardedOptimizer",
    "UnusedParametersError",
    "UsageError",
    "any_rank",
    "average_gradients",
    "clip_grad_norm_",
]
