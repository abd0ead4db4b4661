"""FSDP2 inside, gradsync across: gradients of a module sharded with torch's ``fully_shard``,
synchronised by gradsync over a second mesh axis (replicate, or context parallel).

- ``replicate.py``: :func:`replicate_gradients`, the entry point, and the per-step path (the
  hook FSDP2 calls after each group's reduce-scatter, the end of backward, the scaling);
- ``layout.py``: which modules FSDP2 manages, on which mesh, and what is refused up front.
"""

from gradsync.fsdp.replicate import ReplicatedGradients, replicate_gradients

__all__ = ["ReplicatedGradients", "replicate_gradients"]
