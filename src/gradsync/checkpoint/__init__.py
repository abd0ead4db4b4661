"""Checkpoints that cannot lie.

- :class:`Checkpointer` (``training.py``): the whole training state of every rank (model,
  optimizer, LR scheduler, gradsync's counters, data position, RNG states) in a
  ``torch.distributed.checkpoint`` folder per step, committed atomically, checksummed,
  verified on load, newest complete one first; synchronous or asynchronous.
- :func:`save_checkpoint` / :func:`load_checkpoint` (``files.py``): one file, written by one
  rank, atomic, checksummed, loaded with ``weights_only=True``.
"""

from gradsync.checkpoint.files import load_checkpoint, save_checkpoint
from gradsync.checkpoint.training import Checkpointer

__all__ = ["Checkpointer", "load_checkpoint", "save_checkpoint"]
