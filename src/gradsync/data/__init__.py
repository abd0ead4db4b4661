"""Samplers for data-parallel training.

- :class:`DistributedSampler`: torch's sampler, plus ``state_dict`` / ``load_state_dict`` to
  resume in the middle of an epoch at the same world size.
- :func:`leaf_range`: the leaves of a step a rank holds in the deterministic mode (what
  ``GlobalBatchSampler(..., deterministic=True)`` hands out).
- :class:`GlobalBatchSampler`: a step's samples that do not depend on the world size, split
  into each rank's micro-batches, and a position that resumes at any world size.
- :func:`sample_seed`, :func:`sample_generator`: random numbers that follow a sample to
  whatever rank loads it.
"""

from gradsync.comm.tree import leaf_range
from gradsync.data.global_batches import GlobalBatchSampler
from gradsync.data.per_sample import sample_generator, sample_seed
from gradsync.data.resumable import DistributedSampler

__all__ = [
    "DistributedSampler",
    "GlobalBatchSampler",
    "leaf_range",
    "sample_generator",
    "sample_seed",
]
