"""Where each rank's share of the optimizer state lies: flat buckets cut into equal slices (pure).

ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) keeps parameters and gradients replicated and shards only the optimizer state:
for fp32 Adam that is 16 bytes per parameter unsharded and ``8 + 8/d`` over ``d`` ranks.

The layout follows Megatron-LM's distributed optimizer rather than torch's
``ZeroRedundancyOptimizer``. ZeroRedundancyOptimizer hands out whole parameters, so one large
embedding can leave one rank with most of the state, and it broadcasts each parameter from its
owner after the step. Here the parameters of a bucket are laid end to end in one flat buffer,
the buffer is padded to a multiple of ``world_size * align`` and cut into ``world_size`` equal,
contiguous slices. Equal slices are what ``reduce_scatter`` and ``all_gather`` need (one call per
bucket, no per-parameter traffic), and they balance the state whatever the parameter sizes: a
slice holds ``ceil(numel / (world_size * align)) * align < numel / world_size + align``
elements, so no rank's share exceeds ``1/d`` of the bucket by a full alignment unit. The padding
lies at the end of the buffer, so the last ranks may hold fewer real elements, or none.

A slice may cut through a parameter; the part of a parameter inside one rank's slice is a
:class:`Piece`. Elementwise optimizers (SGD, Adam, ...) give the same result on pieces as on
whole parameters, which is why only those are supported.

Everything here is pure: sizes in, layout out, no process group, so it is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_ALIGN = 16
"""Elements each slice size is a multiple of: 64 bytes in fp32, so every rank's slice starts on
a cache-line boundary (and on the 16-byte boundary vectorised GPU kernels want in 16-bit)."""


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's slice of its bucket."""

    param: int  # position of the parameter in its bucket
    start: int  # first element of the (flattened) parameter in the slice
    end: int  # one past the last element
    shard_offset: int  # where the piece begins inside the rank's slice

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardLayout:
    """One flat bucket: where each parameter lives, and each rank's equal slice of it."""

    numels: tuple[int, ...]  # elements of each parameter, in bucket order
    offsets: tuple[int, ...]  # where each parameter begins in the flat buffer
    world_size: int
    align: int

    @property
    def numel(self) -> int:
        """Elements of parameters in the bucket (no padding)."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's slice (padding included): a multiple of ``align``."""
        unit = self.world_size * self.align
        return -(-self.numel // unit) * self.align

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer: ``world_size`` slices."""
        return self.shard_numel * self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s slice in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The parts of parameters inside ``rank``'s slice, in buffer order (may be empty)."""
        lo, hi = self.rank_range(rank)
        out = []
        for i, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                out.append(Piece(i, start - offset, end - offset, start - lo))
        return tuple(out)

    def owners(self, param: int) -> list[tuple[int, Piece]]:
        """``(rank, piece)`` for every rank holding part of parameter ``param``, in rank order."""
        if self.numels[param] == 0:
            return []
        first = self.offsets[param] // self.shard_numel
        last = (self.offsets[param] + self.numels[param] - 1) // self.shard_numel
        return [(r, p) for r in range(first, last + 1) for p in self.pieces(r) if p.param == param]


def plan_shards(
    buckets: Sequence[Sequence[int]], world_size: int, align: int = DEFAULT_ALIGN
) -> list[ShardLayout]:
    """Lay out each bucket, given as the element counts of its parameters in order.

    Returns one :class:`ShardLayout` per bucket: parameters end to end, the buffer padded to a
    multiple of ``world_size * align``, rank ``r`` owning ``layout.rank_range(r)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    layouts = []
    for numels in buckets:
        if any(n < 0 for n in numels):
            raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        layouts.append(ShardLayout(tuple(numels), tuple(offsets), world_size, align))
    return layouts


def group_by_dtype(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The default buckets: positions of ``params`` grouped by (dtype, device), in order of
    first appearance (a flat buffer holds one dtype on one device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, p.device), []).append(i)
    return list(groups.values())
