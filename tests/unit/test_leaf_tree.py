"""The fixed leaf tree ([Note: the fixed leaf tree] in gradsync/comm/tree.py), on one process:
the pieces any number of ranks fold and the owner combines are the definition's bits, for every
leaf count and world size tried; the sampler's leaves are the same samples at every N."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm.ring import chunk_bounds
from gradsync.comm.tree import (
    TreeFold,
    block_pieces,
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
        fold.close(present)
        assert [n for n, _ in fold.pieces()] == block_pieces(block.start, fold.start + fold.count,
                                                             present)  # fmt: skip
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


def most_pieces(blocks: tuple[range, ...], leaves: int) -> int:
    return max(len(block_pieces(b.start, b.stop, leaves)) for b in blocks)


def test_blocks_tile_the_leaves_with_at_most_three_pieces_within_an_eighth_more_compute() -> None:
    fourth = []
    for leaves in range(1, 70):
        for world in range(1, leaves + 1):
            blocks = leaf_blocks(leaves, world)
            assert [i for b in blocks for i in b] == list(range(leaves))
            even = -(-leaves // world)
            assert max(map(len, blocks)) <= even + even // 8 and min(map(len, blocks)) >= 1
            even_cut = tuple(range(a, b) for a, b in chunk_bounds(leaves, world))
            assert most_pieces(blocks, leaves) <= most_pieces(even_cut, leaves)
            if most_pieces(blocks, leaves) > 3:
                fourth.append((leaves, world))
    assert fourth == [(68, 4)]  # 4 pieces, or 3 in blocks of 20 where the even share is 17
    assert leaf_blocks(16, 3) == (range(0, 4), range(4, 10), range(10, 16))  # 1, 2, 2 pieces
    assert leaf_blocks(16, 4) == (range(0, 4), range(4, 8), range(8, 12), range(12, 16))
    assert leaf_blocks(32, 3) == (range(0, 8), range(8, 20), range(20, 32))  # 12 for 2 pieces
    assert dyadic_pieces(3, 9) == [(3, 1), (4, 4), (8, 1)]
    assert block_pieces(12, 23, 23) == [(12, 4), (16, 16)]  # closed: 24..31 hold nothing
    assert block_pieces(12, 20, 23) == dyadic_pieces(12, 20) == [(12, 4), (16, 4)]
    assert positions(1) == 1 and positions(5) == 8 and positions(8) == 8
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_a_power_of_two_of_leaves_costs_at_most_twice_an_all_reduce() -> None:
    # A rank with k pieces sends (k + 1) / 2 times an all-reduce's bytes (tree_exchange.py):
    # one piece each where the world size is a power of two too, at most three otherwise.
    for leaves in (8, 16, 32, 64, 128, 256):
        for world in range(1, 17):
            blocks = leaf_blocks(leaves, world)
            layout = StepLayout([len(b) for b in blocks], list(blocks))
            most = max(len(p) for p in layout.pieces)
            assert most == 1 if world & (world - 1) == 0 and world <= leaves else most <= 3
            even = -(-leaves // world)
            assert max(map(len, blocks)) <= even + even // 8, (leaves, world)


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
