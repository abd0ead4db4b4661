"""The fixed leaf tree ([Note: the fixed leaf tree] in gradsync/comm/tree.py), on one process:
the pieces any number of ranks fold and the owner combines are the definition's bits, for every
leaf count and world size tried; the sampler's leaves are the same samples at every N."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm.ring import chunk_bounds
from gradsync.comm.tree import (
    TreeFold,
    combine,
    dyadic_pieces,
    leaf_blocks,
    leaf_range,
    naive_tree_sum,
    positions,
)
from gradsync.comm.tree_exchange import StepLayout
from gradsync.data import GlobalBatchSampler
from gradsync.errors import UsageError


def _leaves(count: int) -> list[torch.Tensor]:
    # Values of very different magnitudes: float32 sums in another order differ in the bits.
    g = torch.Generator().manual_seed(count)
    return [torch.randn(64, generator=g) * 10.0 ** torch.randint(-4, 5, (64,), generator=g)
            for _ in range(count)]  # fmt: skip


def _fold_and_combine(leaves: list[torch.Tensor], world: int, present: int) -> torch.Tensor:
    pieces = {}
    for rank in range(world):
        block = leaf_range(len(leaves), world, rank)
        fold = TreeFold(block.start)
        for i in block:
            if i < present:
                fold.add(leaves[i].clone())
        assert [n for n, _ in fold.pieces()] == dyadic_pieces(block.start, fold.start + fold.count)
        pieces.update(dict(fold.pieces()))
    root = combine(pieces, present)
    assert root is not None
    return root


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 10, 13, 16, 24])
def test_any_world_size_gives_the_definitions_bits(count: int) -> None:
    leaves = _leaves(count)
    expected = naive_tree_sum(leaves)
    assert expected is not None
    for world in range(1, count + 1):
        assert torch.equal(_fold_and_combine(leaves, world, count), expected), world
    # the test can fail: a plain left-to-right sum has other bits
    plain = leaves[0].clone()
    for t in leaves[1:]:
        plain += t
    assert count < 4 or not torch.equal(plain, expected)  # 3: ((0 + 1) + 2) either way


def test_a_short_step_is_the_tree_of_its_leaves() -> None:
    leaves = _leaves(10)
    for present in (1, 4, 7, 9):
        expected = naive_tree_sum(leaves[:present])
        assert expected is not None
        for world in (1, 2, 3, 4, 6):
            assert torch.equal(_fold_and_combine(leaves, world, present), expected)


def test_blocks_tile_the_leaves_in_rank_order_and_are_cut_along_the_tree() -> None:
    def most_pieces(blocks: tuple[range, ...]) -> int:
        return max(len(dyadic_pieces(b.start, b.stop)) for b in blocks)

    for leaves in range(1, 70):
        for world in range(1, leaves + 1):
            blocks = leaf_blocks(leaves, world)
            assert [i for b in blocks for i in b] == list(range(leaves))
            assert max(map(len, blocks)) == -(-leaves // world) and min(map(len, blocks)) >= 1
            even = tuple(range(a, b) for a, b in chunk_bounds(leaves, world))
            assert most_pieces(blocks) <= most_pieces(even)
    assert leaf_blocks(16, 3) == (range(0, 4), range(4, 10), range(10, 16))  # 1, 2, 2 pieces
    assert leaf_blocks(16, 4) == (range(0, 4), range(4, 8), range(8, 12), range(12, 16))
    assert dyadic_pieces(3, 9) == [(3, 1), (4, 4), (8, 1)]
    assert positions(1) == 1 and positions(5) == 8 and positions(8) == 8
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_a_power_of_two_world_dividing_the_leaves_has_one_piece_per_rank() -> None:
    # What makes the exchange cost an all-reduce's bytes (tree_exchange.py).
    for world in (1, 2, 4, 8):
        layout = StepLayout([16 // world] * world, [leaf_range(16, world, r) for r in range(world)])
        assert all(len(p) == 1 for p in layout.pieces)


def test_leaf_counts_that_break_the_layout_are_refused_naming_the_rank() -> None:
    blocks = [leaf_range(10, 3, r) for r in range(3)]
    assert StepLayout([4, 3, 0], blocks).total == 7  # a short last step
    with pytest.raises(UsageError, match="rank 0 ran 5 leaves"):
        StepLayout([5, 3, 3], blocks)
    with pytest.raises(UsageError, match="rank 1 ran 2 leaves"):
        StepLayout([4, 2, 3], blocks)  # a gap: leaf 6 missing, 7..9 present


def test_the_sampler_hands_out_the_same_leaves_at_every_world_size() -> None:
    def leaves(world: int, length: int) -> list[list[int]]:
        out: list[list[int]] = []
        for rank in range(world):
            s = GlobalBatchSampler(
                range(length), 20, 2, num_replicas=world, rank=rank, seed=5, deterministic=True
            )
            out += list(s)  # rank order is leaf order within each step: compare per step
        return out

    for length in (60, 54):  # 54: a short last step of 7 leaves
        one = leaves(1, length)
        for world in (2, 3, 4, 7):
            got = leaves(world, length)
            assert sorted(map(tuple, got)) == sorted(map(tuple, one)), world
    s = GlobalBatchSampler(range(60), 20, 2, num_replicas=3, rank=2, deterministic=True)
    assert s.leaves_per_step == 10 and s.micro_batches_per_step == 2  # blocks of 4, 4, 2
    with pytest.raises(UsageError, match="needs micro_batch_size"):
        GlobalBatchSampler(range(60), 20, num_replicas=3, rank=0, deterministic=True)
    with pytest.raises(UsageError, match="cannot give each of num_replicas=12"):
        GlobalBatchSampler(range(60), 20, 2, num_replicas=12, rank=0, deterministic=True)
