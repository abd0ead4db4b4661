"""Data parallelism: the naive reference (``naive``) and the overlapped wrapper (``wrapper``)."""

from gradsync.ddp.deadline import CollectiveTimeoutError
from gradsync.ddp.diagnostics import ReplicaMismatchError, any_rank
from gradsync.ddp.naive import average_gradients
from gradsync.ddp.reducer import NonFiniteGradientError, UnusedParametersError
from gradsync.ddp.wrapper import DistributedDataParallel

__all__ = [
    "CollectiveTimeoutError",
    "DistributedDataParallel",
    "NonFiniteGradientError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "any_rank",
    "average_gradients",
]
