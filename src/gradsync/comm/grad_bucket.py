"""A stand-in for ``torch.distributed.GradBucket``, which torch 2.13 gives no Python constructor.

torch's communication hooks (``register_comm_hook``, ``torch_hooks.py``) receive one per
bucket: ``buffer()`` is the bucket's flat gradients, ``gradients()`` views of the current buffer
shaped like ``parameters()``, ``set_buffer()`` replaces it, ``index()`` and ``is_last()``
number the buckets in launch order. Same methods, same meanings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GradBucketView:
    """Stands in for ``torch.distributed.GradBucket`` (same methods, same meanings)."""

    def __init__(
        self, index: int, num_buckets: int, buffer: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> None:
        self._index = index
        self._is_last = index == num_buckets - 1
        self._buffer = buffer
        self._params = list(params)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of the current buffer, one per parameter, shaped like it."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views
