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
the tree. A piece is one buffer the size of the gradients: where every rank's block is one
subtree (``L = N 2^j``: 16 leaves on 2, 4 or 8 ranks) every rank has one, and the exchange
costs the bytes of an all-reduce (``tree_exchange.py``); otherwise a block splits into a few
pieces, at most three (:func:`leaf_blocks`), at most twice those bytes.

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


MOST_PIECES = 3  # per rank: an exchange of at most twice an all-reduce's bytes (see below)


@functools.lru_cache(maxsize=64)
def leaf_blocks(leaves: int, world_size: int) -> tuple[range, ...]:
    """Every rank's block of leaves, none empty when there are enough leaves.

    Two costs pull apart. The step's compute is its longest block's, at best
    ``ceil(leaves / world_size)``; the exchange sends, from a rank whose block is ``k`` pieces
    (:func:`block_pieces`), ``(k + 1) / 2`` times an all-reduce's bytes (``tree_exchange.py``):
    one piece each costs an all-reduce's bytes, three, twice. Blocks that start and end where
    the tree's large subtrees do have few pieces, but cannot always be that even. So the cut is
    searched exactly (:func:`_shortest`): the fewest pieces at the most among the cuts of
    blocks of at most ``ceil(leaves / world_size)`` leaves; if that is more than
    :data:`MOST_PIECES`, the cut of at most that many pieces whose longest block is shortest,
    if it is at most an eighth longer (compute is the larger cost where the link is fast);
    else the fewest pieces within that eighth. 16 leaves on 3 ranks: ``[0, 4) [4, 10) [10,
    16)``, 1, 2 and 2 pieces (the even cut ``[0, 6) [6, 11) [11, 16)`` has 2, 3 and 2); 32 on
    3: blocks of up to 12 leaves, not 11, for 2 pieces, not 4. With a power of two of leaves
    (a fixed micro-batch, a global batch a power of two) every world size up to 16 gets at
    most 3 pieces, and one where it is a power of two too; ``tests/unit/test_leaf_tree.py``
    checks both, and how often other leaf counts need a fourth piece.
    """
    if leaves < world_size:  # some ranks hold none: the deterministic mode refuses this
        return tuple(range(a, b) for a, b in chunk_bounds(leaves, world_size))
    even = -(-leaves // world_size)
    for most in range(1, MOST_PIECES + 1):
        if (cut := _shortest(leaves, world_size, even, most)) is not None:
            return cut
    most = MOST_PIECES
    while (cut := _shortest(leaves, world_size, even + even // 8, most)) is None:
        most += 1  # not within an eighth more compute: the fewest pieces that are
    return cut


def _shortest(leaves: int, world_size: int, longest: int, most: int) -> tuple[range, ...] | None:
    """The cut into ``world_size`` non-empty blocks of at most ``longest`` leaves and ``most``
    pieces whose longest block is shortest (the earliest boundaries on a tie), or ``None`` if
    there is none: a minimax, by dynamic programming over (first leaf, ranks left)."""

    @functools.cache
    def best(first: int, ranks: int) -> tuple[int, int] | None:  # (longest block, its end)
        if ranks == 0:
            return (0, first) if first == leaves else None
        options = []
        for end in range(first + 1, min(first + longest, leaves - ranks + 1) + 1):
            rest = best(end, ranks - 1)
            if rest is not None and _num_pieces(first, end, leaves) <= most:
                options.append((max(end - first, rest[0]), end))
        return min(options, default=None)

    if best(0, world_size) is None:
        return None
    bounds = [0]
    for ranks in range(world_size, 0, -1):
        found = best(bounds[-1], ranks)
        assert found is not None
        bounds.append(found[1])
    return tuple(range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


@functools.lru_cache(maxsize=65536)
def _num_pieces(start: int, stop: int, present: int) -> int:
    return len(block_pieces(start, stop, present))


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


def block_pieces(start: int, stop: int, present: int) -> list[Node]:
    """The pieces rank's block ``[start, stop)`` sends in a step of ``present`` leaves: its
    :func:`dyadic_pieces`, *closed* where the block holds the step's last leaf: a node whose
    right sibling holds no leaf is, in the tree, its own parent (the one child holding any
    leaf), so the block's trailing nodes fold on up the tree on its own rank. ``[12, 23)`` of
    23 leaves: ``(12, 4), (16, 16)``, not ``(12, 4), (16, 4), (20, 2), (22, 1)``."""
    nodes: list[tuple[Node, None]] = [(n, None) for n in dyadic_pieces(start, stop)]
    _close(nodes, present, lambda left, right: None)
    return [n for n, _ in nodes]


def _siblings(left: Node, right: Node) -> bool:
    return left[1] == right[1] and left[0] % (2 * left[1]) == 0 and right[0] == left[0] + left[1]


def _close(nodes: list[tuple[Node, T]], present: int, plus: Callable[[T, T], T]) -> None:
    """Fold ``nodes`` (a block's, in order) up the tree of ``present`` leaves where the block
    ends the step: while the last node is a left child whose sibling holds no leaf it becomes
    its parent, and merges with the node before it when they are then siblings."""
    root = positions(present)
    while nodes:
        (first, size), value = nodes[-1]
        if first % (2 * size) or first + size < present or 2 * size > root:
            return
        nodes[-1] = ((first, 2 * size), value)  # the parent: no addition, as in the tree
        while len(nodes) >= 2 and _siblings(nodes[-2][0], nodes[-1][0]):
            (first, size), left = nodes[-2]
            nodes[-2:] = [((first, 2 * size), plus(left, nodes[-1][1]))]


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
        while len(nodes) >= 2 and _siblings(nodes[-2][0], nodes[-1][0]):
            (first, size), left = nodes[-2]
            nodes[-2:] = [((first, 2 * size), self.plus(left, nodes[-1][1]))]

    def close(self, present: int) -> None:
        """The step has ``present`` leaves: if this block holds its last one, fold the trailing
        nodes on up the tree (:func:`block_pieces`). Idempotent."""
        _close(self.nodes, present, self.plus)

    def pieces(self) -> list[tuple[Node, T]]:
        """The nodes now: :func:`dyadic_pieces` of the leaves added (closed, after
        :meth:`close`: :func:`block_pieces`), with their sums."""
        return list(self.nodes)


def combine(pieces: Mapping[Node, torch.Tensor], leaves: int) -> torch.Tensor | None:
    """The tree's root over ``leaves`` leaf positions given nodes that tile the leaves present
    (``None`` if none is): from the root down to the given nodes, then ``left + right`` back
    up. The tensors of ``pieces`` may be written to (they are scratch)."""
    return _node(pieces, leaves, 0, positions(leaves))


def _node(
    pieces: Mapping[Node, torch.Tensor], leaves: int, first: int, size: int
) -> torch.Tensor | None:
    # Not a closure over ``pieces``: a recursive inner function is a reference cycle, which
    # kept the pieces (views of a bucket's buffer) alive until the next garbage collection.
    given = pieces.get((first, size))
    if given is not None or size == 1:
        return given
    half = size // 2
    left = _node(pieces, leaves, first, half)
    right = _node(pieces, leaves, first + half, half) if first + half < leaves else None
    if left is None or right is None:
        return left if right is None else right
    return left.add_(right)


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
