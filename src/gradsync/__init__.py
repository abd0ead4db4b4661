"""gradsync: data-parallel training on torch.distributed that equals one-device training."""

from gradsync.ddp import (
    CollectiveTimeoutError,
    DistributedDataParallel,
    NonFiniteGradientError,
    ReplicaMismatchError,
    UnusedParametersError,
    any_rank,
    average_gradients,
)

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "DistributedDataParallel",
    "NonFiniteGradientError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "any_rank",
    "average_gradients",
]
