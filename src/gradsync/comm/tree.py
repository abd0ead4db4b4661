"""A sum whose order does not depend on how many ranks computed it: the fixed leaf tree.

[Note: the fixed leaf tree]
Floating-point addition is commutative but not associative: ``(a + b) + c`` and ``a + (b + c)``
may differ in the last bit. An all-reduce over N ranks adds the ranks' gradients in an order
that depends on N (and on the backend's algorithm), and a rank's gradient is itself a sum over
its micro-batches, so the same global batch gives a different synchronised gradient at every
world size, by rounding. After thousands of steps those are different models.

The deterministic mode fixes the order. A step's global batch is cut into ``L`` *leaves*
(micro-batches of a fixed size, the same at every N); leaf ``i``'s gradient ``g_i`` comes from
its own backward on whichever rank holds it. The step's gradient is the sum of the ``g_i`` over
one binary tree that depends only on ``L``: the complete binary tree over ``P`` leaf positions,
``P`` the smallest power of two ``>= L``, in which a node is the sum ``left + right`` of its
children, or the one child that holds any leaf. (A leaf position past the step's last leaf holds
nothing, so a short last step is summed by the same tree, its empty positions skipped.) Where
``g_i`` is computed never enters; only ``i`` does.

Rank ``r`` of N holds a contiguous block of leaves (:func:`leaf_range`). It adds its leaves into
every *maximal aligned dyadic* interval of its block (:func:`dyadic_pieces`), each one a node of
the tree, computed exactly as the tree computes it (:class:`TreeFold`, as the leaves arrive).
Those pieces, from all ranks, tile the step's leaves; :func:`combine` adds them up the rest of
the tree. A piece is one buffer the size of the gradients: with N a power of two dividing ``L``
every rank has one, and the exchange costs the bytes of an all-reduce (``tree_exchange.py``);
otherwise a block splits into a few pieces.

:func:`naive_tree_sum` is the definition: the recursion over the leaves themselves, all in one
place. The tests check that pieces folded on any number of ranks and combined give its bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import torch

from gradsync.comm.ring import chunk_bounds

Node = tuple[int, int]  # (first leaf, number of leaf positions): a node of the tree


def leaf_range(leaves: int, world_size: int, rank: int) -> range:
    """The leaves of a step of ``leaves`` leaves that ``rank`` of ``world_size`` holds: a
    contiguous block, the blocks in rank order being the leaves in order (:func:`leaf_blocks`)."""
    return leaf_blocks(leaves, world_size)[rank]


@functools.lru_cache(maxsize=64)
def leaf_blocks(leaves: int, world_size: int) -> tuple[range, ...]:
    """Every rank's block of leaves. Each holds at most ``ceil(leaves / world_size)`` (the
    step's compute is its longest block's) and at least one when there are enough leaves. Of
    two such cuts, the one whose ranks hold fewer pieces (:func:`dyadic_pieces`: what a rank
    sends) at the most, the even one on a tie:

    - *even*: sizes differ by at most one, the longer blocks first;
    - *along the tree*: each boundary, rank by rank, at the position with the most trailing
      zero bits (the latest on a tie) that leaves the ranks after it a feasible cut, so that
      blocks begin and end where the tree's large subtrees do. 16 leaves on 3 ranks: even
      ``[0, 6) [6, 11) [11, 16)`` has 2, 3 and 2 pieces; along the tree ``[0, 4) [4, 10)
      [10, 16)`` has 1, 2 and 2.
    """
    even = tuple(range(a, b) for a, b in chunk_bounds(leaves, world_size))
    longest = -(-leaves // world_size)
    bounds = [0]
    for r in range(1, world_size):
        after = world_size - r  # ranks still to place, one leaf each at least
        ends = [
            e for e in range(bounds[-1] + 1, bounds[-1] + longest + 1)
            if min(after, leaves) <= leaves - e <= after * longest
        ]  # fmt: skip
        if not ends:  # fewer leaves than ranks: the even cut
            return even
        bounds.append(max(ends, key=lambda e: ((e & -e).bit_length(), e)))
    bounds.append(leaves)
    cut = tuple(range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True))

    def most_pieces(blocks: tuple[range, ...]) -> int:
        return max(len(dyadic_pieces(b.start, b.stop)) for b in blocks)

    return cut if most_pieces(cut) < most_pieces(even) else even


def positions(leaves: int) -> int:
    """``P``: the leaf positions of the tree over ``leaves`` leaves, a power of two."""
    return 1 << max(leaves - 1, 0).bit_length()


def dyadic_pieces(start: int, stop: int) -> list[Node]:
    """``[start, stop)`` cut into maximal aligned dyadic intervals ``(first, size)``, in order:
    each starts at a multiple of its size, a power of two, and is a node of every tree over
    at least ``stop`` leaves. ``[3, 9)`` gives ``(3, 1), (4, 4), (8, 1)``."""
    out: list[Node] = []
    while start < stop:
        size = start & -start if start else positions(stop)  # the largest aligned at start
        while start + size > stop:
            size //= 2
        out.append((start, size))
        start += size
    return out


T = TypeVar("T")


def _add_into(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return left.add_(right)  # left + right: addition commutes, so in place is the same bits


class TreeFold(Generic[T]):
    """The pieces of one rank's block of leaves, summed as the tree sums them, leaf by leaf.

    :meth:`add` takes the leaves in order, from ``start``. A new leaf is a node of size 1; while
    the last two nodes are siblings in the tree (the same size ``s``, the first at a multiple of
    ``2 s``) they merge into their parent, ``left + right``. So at any time the nodes are the
    maximal aligned dyadic intervals of the leaves added so far, each summed in tree order (a
    binary counter: a leaf costs one addition on average, and at most ``log2`` of a block's
    length nodes wait at once).

    A leaf is a tensor, or anything ``plus(left, right)`` adds into ``left`` and returns (the
    deterministic mode's buckets fold lists of per-parameter gradients with one
    ``_foreach_add_`` each).
    """

    def __init__(self, start: int, plus: Callable[[T, T], T] = _add_into) -> None:  # type: ignore[assignment]
        self.start = start
        self.count = 0  # leaves added
        self.nodes: list[tuple[Node, T]] = []
        self.plus = plus

    def add(self, leaf: T, size: int = 1) -> None:
        """Add the next leaf's gradient (this fold keeps ``leaf``, and adds into it); ``size=2``:
        the next two leaves' sum, ``first + second``, the first at an even position."""
        nodes = self.nodes
        assert size == 1 or (size == 2 and (self.start + self.count) % 2 == 0)
        nodes.append(((self.start + self.count, size), leaf))
        self.count += size
        while len(nodes) >= 2:
            (first, size), left = nodes[-2]
            (second, size2), right = nodes[-1]
            if size != size2 or first % (2 * size):
                break
            assert second == first + size
            nodes[-2:] = [((first, 2 * size), self.plus(left, right))]

    def pieces(self) -> list[tuple[Node, T]]:
        """The nodes now: :func:`dyadic_pieces` of the leaves added, with their sums."""
        return list(self.nodes)


def combine(pieces: Mapping[Node, torch.Tensor], leaves: int) -> torch.Tensor | None:
    """The tree's root over ``leaves`` leaf positions given nodes that tile the leaves present
    (``None`` if none is): from the root down to the given nodes, then ``left + right`` back
    up. The tensors of ``pieces`` may be written to (they are scratch)."""

    def node(first: int, size: int) -> torch.Tensor | None:
        given = pieces.get((first, size))
        if given is not None or size == 1:
            return given
        half = size // 2
        left = node(first, half)
        right = node(first + half, half) if first + half < leaves else None
        if left is None or right is None:
            return left if right is None else right
        return left.add_(right)

    return node(0, positions(leaves))


def naive_tree_sum(leaves: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The definition, on one process: the tree over ``leaves`` (``None``: a leaf position
    holding nothing), recursively, out of place."""

    def node(first: int, size: int) -> torch.Tensor | None:
        if first >= len(leaves):
            return None
        if size == 1:
            return leaves[first]
        half = size // 2
        left, right = node(first, half), node(first + half, half)
        if left is None or right is None:
            return left if right is None else right
        return left + right

    return node(0, positions(len(leaves)))
