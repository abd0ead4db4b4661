"""Checkpoints that cannot lie.

- :func:`save_checkpoint` / :func:`load_checkpoint` (``files.py``): one file, written by one
  rank, atomic, checksummed, loaded with ``weights_only=True``.
"""

from gradsync.checkpoint.files import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
