"""Two-level all-reduce: within each node, then across nodes, then within each node again.

With L ranks per node and M nodes (N = L * M), rank ``(node, local)``:

1. reduce-scatters the tensor over its node (a ring of L ranks): it ends up holding the node's
   sum of chunk ``local + 1`` of L;
2. all-reduces that chunk with the ranks of the same local index on the other nodes (a ring of
   M ranks), so the M*L-way sum of each chunk exists on one rank per node;
3. all-gathers the chunks over its node.

Every rank still sends 2(N-1)/N of the tensor, like the flat ring, but only 2(M-1)/(M*L) of it
crosses a node boundary, and all L local ranks drive the inter-node links in parallel instead
of one leader per node. Each phase reuses the ring of :mod:`gradsync.comm.ring` (Patarasuk &
Yuan 2009), so chunking, tags and half-precision accumulation behave exactly as there.

Ranks are assumed to be numbered contiguously per node (``node = rank // local_world_size``),
which is how torchrun assigns them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.comm.ring import (
    DEFAULT_SEGMENT_BYTES,
    Ring,
    ThreadedAllReduce,
    chunk_bounds,
)


def _resolve_local_world_size(local_world_size: int | None) -> int | None:
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None or env.strip() == "":
            return None  # one node holding every rank of the group
        try:
            local_world_size = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {env!r}") from None
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    return local_world_size


def _group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group`` was created with, if this torch version lets us read it.

    ``new_group`` does not inherit the parent's timeout (it falls back to torch's 30-minute
    default), so without this a hang in a subgroup would outlive the parent's deadline.
    """
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return None
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


@dataclass(frozen=True)
class _Plan:
    node: Ring
    cross: Ring


class HierarchicalAllReduce(ThreadedAllReduce[_Plan]):
    """Intra-node reduce-scatter, inter-node ring all-reduce, intra-node all-gather.

    ``local_world_size`` is the number of ranks per node; ``None`` reads torchrun's
    ``LOCAL_WORLD_SIZE`` and, when that is unset too, treats the whole group as one node (which
    makes this a plain ring). ``timeout`` is passed to the subgroups it creates; by default they
    get the parent group's own timeout.

    The node and cross-node subgroups are created on the first all-reduce over a parent group
    and cached. Creating a group is itself a collective, so it happens on the caller's thread,
    in program order, on every rank: for the default group every rank creates every subgroup in
    the same order (torch names groups by a per-process counter); for any other parent group
    the subgroups are created with ``use_local_synchronization`` so ranks outside the parent need
    not take part, which requires every member of the parent to have created the same number of
    process groups before.
    """

    name = "hierarchical"

    def __init__(
        self,
        local_world_size: int | None = None,
        timeout: timedelta | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        super().__init__(segment_bytes)
        self.local_world_size = _resolve_local_world_size(local_world_size)
        self.timeout = timeout
        self._plans: dict[dist.ProcessGroup, _Plan] = {}
        self._plans_lock = threading.Lock()

    def _prepare(self, group: dist.ProcessGroup | None) -> _Plan:
        parent = group if group is not None else dist.group.WORLD
        assert parent is not None, "default process group is not initialised"
        with self._plans_lock:
            plan = self._plans.get(parent)
            if plan is None:
                plan = self._plans[parent] = self._build_plan(parent)
        return plan

    def _build_plan(self, parent: dist.ProcessGroup) -> _Plan:
        size = dist.get_world_size(parent)
        local_size = self.local_world_size if self.local_world_size is not None else size
        if size % local_size != 0:
            raise ValueError(f"world size {size} is not divisible by local_world_size {local_size}")
        nodes = size // local_size
        node, local = divmod(dist.get_rank(parent), local_size)
        ranks = [dist.get_global_rank(parent, r) for r in range(size)]
        node_members = [ranks[n * local_size : (n + 1) * local_size] for n in range(nodes)]
        cross_members = [ranks[i::local_size] for i in range(local_size)]
        is_world = parent is dist.group.WORLD
        timeout = self.timeout if self.timeout is not None else _group_timeout(parent)
        node_group = self._subgroup(parent, node_members, node, is_world, timeout)
        cross_group = self._subgroup(parent, cross_members, local, is_world, timeout)
        return _Plan(
            node=Ring(node_group, tuple(node_members[node]), local),
            cross=Ring(cross_group, tuple(cross_members[local]), node),
        )

    @staticmethod
    def _subgroup(
        parent: dist.ProcessGroup,
        members: Sequence[Sequence[int]],
        mine: int,
        is_world: bool,
        timeout: timedelta | None,
    ) -> dist.ProcessGroup:
        """The group of ``members[mine]``, creating one group per member list on every rank.

        No group is created when one list holds every rank (the parent itself serves) or when
        the lists are singletons (a ring of one sends nothing); both cases are decided from the
        sizes alone, so every rank makes the same choice and group creation stays in step.
        """
        if len(members) == 1 or len(members[0]) == 1:
            return parent
        mine_group = None
        for ranks in members:
            created = dist.new_group(
                list(ranks), timeout=timeout, use_local_synchronization=not is_world
            )
            if ranks is members[mine]:
                mine_group = created
        assert isinstance(mine_group, dist.ProcessGroup)
        return mine_group

    def _sum(self, flat: torch.Tensor, plan: _Plan) -> None:
        owned = self._runner.reduce_scatter(flat, plan.node)
        start, stop = chunk_bounds(flat.numel(), plan.node.size)[owned]
        if stop > start:
            self._runner.all_reduce(flat[start:stop], plan.cross)
        self._runner.all_gather(flat, plan.node)
