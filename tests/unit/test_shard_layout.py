"""Planning of ShardedOptimizer's flat buckets: equal contiguous slices that cover every element
exactly once, balanced within one alignment unit, for any sizes and world sizes."""

from __future__ import annotations

import random

import pytest
import torch

import gradsync
from gradsync.optim import plan_shards
from gradsync.optim.buffers import check_optimizer_class
from gradsync.optim.layout import group_by_dtype

SIZES = [
    [1],
    [0],
    [7],
    [3, 0, 5],
    [35, 7, 21, 3, 1],  # the test model of tests/dist/test_sharded_optimizer.py: 67 elements
    [1000, 1, 1, 1],
    [13] * 9,
    [0, 0, 2],
]


def _check(numels: list[int], world: int, align: int) -> None:
    (layout,) = plan_shards([numels], world, align)
    total = sum(numels)
    assert layout.numel == total
    assert layout.padded_numel % (world * align) == 0
    assert layout.padded_numel == layout.shard_numel * world
    assert layout.shard_numel % align == 0
    # Balanced: no rank's slice is a full alignment unit above 1/d of the bucket.
    assert layout.shard_numel < total / world + align or total == 0
    assert layout.padded_numel - total < world * align  # padding only where needed
    covered = [[0] * n for n in numels]
    for rank in range(world):
        lo, hi = layout.rank_range(rank)
        assert hi - lo == layout.shard_numel  # equal slices, contiguous, in rank order
        assert lo == rank * layout.shard_numel
        previous_end = 0
        for pc in layout.pieces(rank):
            assert 0 <= pc.start < pc.end <= numels[pc.param]
            # The piece is where the parameter is: offset in the buffer == offset in the slice.
            assert layout.offsets[pc.param] + pc.start == lo + pc.shard_offset
            assert pc.shard_offset >= previous_end  # pieces in buffer order, no overlap
            previous_end = pc.shard_offset + pc.numel
            assert previous_end <= layout.shard_numel
            for e in range(pc.start, pc.end):
                covered[pc.param][e] += 1
    assert all(c == 1 for param in covered for c in param), "each element owned exactly once"
    for i, n in enumerate(numels):
        owners = layout.owners(i)
        assert sum(pc.numel for _, pc in owners) == n
        assert [r for r, _ in owners] == sorted({r for r, _ in owners})


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("align", [1, 4, 16])
def test_slices_cover_every_element_once_and_are_balanced(world: int, align: int) -> None:
    rng = random.Random(world * 100 + align)
    cases = SIZES + [[rng.randrange(0, 50) for _ in range(rng.randrange(1, 12))] for _ in range(20)]
    for numels in cases:
        _check(numels, world, align)


def test_empty_slices_and_pieces_cutting_through_parameters() -> None:
    # 5 elements over 4 ranks (align 1): slices of 2; rank 3 holds only padding.
    (layout,) = plan_shards([[3, 2]], 4, 1)
    assert layout.shard_numel == 2
    assert [len(layout.pieces(r)) for r in range(4)] == [1, 2, 1, 0]
    first, second = layout.pieces(1)
    assert (first.param, first.start, first.end) == (0, 2, 3)  # the tail of parameter 0...
    assert (second.param, second.start, second.end) == (1, 0, 1)  # ...and the head of 1
    assert layout.owners(0) == [(0, layout.pieces(0)[0]), (1, first)]
    # A bucket smaller than one alignment unit lives on rank 0 alone.
    (tiny,) = plan_shards([[3]], 3, 16)
    assert [len(tiny.pieces(r)) for r in range(3)] == [1, 0, 0]
    assert tiny.shard_numel == 16


def test_several_buckets_are_planned_independently() -> None:
    layouts = plan_shards([[5, 5], [1], []], 2, 2)
    assert [la.padded_numel for la in layouts] == [12, 4, 0]
    assert layouts[2].pieces(0) == () and layouts[2].pieces(1) == ()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        plan_shards([[1]], 0)
    with pytest.raises(ValueError, match="align"):
        plan_shards([[1]], 2, 0)
    with pytest.raises(ValueError, match="sizes"):
        plan_shards([[-1]], 2)
    with pytest.raises(ValueError, match="outside"):
        plan_shards([[4]], 2)[0].rank_range(2)


def test_default_buckets_are_one_per_dtype_in_order() -> None:
    params = [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(1)]
    assert group_by_dtype(params) == [[0, 2], [1]]


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam", "Adafactor"])
def test_non_elementwise_optimizers_are_refused_by_name(name: str) -> None:
    with pytest.raises(gradsync.UsageError, match=name):
        check_optimizer_class(getattr(torch.optim, name))


def test_elementwise_optimizers_and_subclasses_are_accepted() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, MyAdamW):
        check_optimizer_class(cls)
    with pytest.raises(gradsync.UsageError, match="optimizer_class"):
        check_optimizer_class(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))
