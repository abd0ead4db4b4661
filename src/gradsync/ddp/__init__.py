"""Data parallelism: the naive reference (``naive``) and the overlapped wrapper (``wrapper``)."""

from gradsync.ddp.naive import average_gradients
from gradsync.ddp.reducer import UnusedParametersError
from gradsync.ddp.wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "UnusedParametersError", "average_gradients"]
