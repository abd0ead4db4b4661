"""gradsync: data-parallel training on torch.distributed that equals one-device training."""

from gradsync.ddp import DistributedDataParallel, UnusedParametersError, average_gradients

__version__ = "0.1.0"

__all__ = ["DistributedDataParallel", "UnusedParametersError", "average_gradients"]
