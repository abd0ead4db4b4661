"""What a job loses whole: a rank on its own, or one replica of a device mesh.

[Note: a mesh under Recovery]
On a flat job every rank holds the whole model, and any rank can go. On a device mesh the
ranks of one data-parallel *replica* (one index of the data-parallel mesh's first axis, e.g.
``dp``) hold parts of one model between them: tensor-parallel shards of the weights, or
context-parallel chunks of the same sequences. Large jobs lay a replica out within a node (the
fast link inside, data parallelism across), so a lost node takes whole replicas, and the
survivors hold every part of the model in each remaining replica. They go on at ``dp - 1``
replicas in the same processes:

1. The loss must be whole replicas. A replica that lost only some of its ranks (one tensor-
   parallel rank) has lost a shard that no one else holds: :class:`NoRecoveryError`, naming
   the ranks, and every survivor takes the restart path.
2. The new default group numbers the survivors in their old order, and the mesh is laid out
   again without the lost replicas (``mesh/rebuild.py``): every other axis keeps its size and
   every rank its coordinates on it, so each rank's shards are still its own.
3. The global batch is split over the replicas, not the ranks: the sampler's ``num_replicas``
   is the number of replicas and its ``rank`` the replica's index, and every rank of a replica
   reads the same share (tensor parallelism splits the weights, context parallelism the
   sequences, both within the replica).
4. A step's optimizer step must be all or none across the job. Without a mesh, the ranks that
   stepped hold the whole step's result and hand it to those that had not ([Note: rolling a
   step back]). With tensor-parallel shards that is not enough: a replica's ranks reduce their
   shards' gradients in separate groups, so one shard could step while another could not, and
   the redone step's forward would mix the two. So each optimizer step begins with a *commit*,
   a collective over every rank: a rank that got past it knows every rank reached it, and so
   had all its gradients reduced. After a loss, if any survivor stepped, every survivor either
   stepped or entered the commit with the step's gradients in ``.grad``, and steps from them
   now (``OptimizerSteps.commit`` in ``rollback.py``). The commit costs one small all-reduce
   per step, and only where the data-parallel group is not the whole job.
5. The collectives a model issues inside its replica (DTensor's, or context parallelism's) are
   not gradsync's: no deadline waits on them. A survivor that begins to regroup destroys its
   groups inside the replica at once, so a peer waiting there for it (one that got past a
   commit it saw fail, and went on to the next forward) sees the connections close; and the
   plain ``RuntimeError`` gloo then raises ends the step as a lost peer once a regroup has
   begun (:meth:`Replicas.lost_inside`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import UsageError
from gradsync.failfast.waiting import RegroupWatch
from gradsync.mesh.rebuild import flattened_axes, rebuild_in_place
from gradsync.recovery.collectives import stamped_barrier
from gradsync.recovery.membership import Membership, NoRecoveryError
from gradsync.recovery.rollback import OptimizerSteps


class Replicas:
    """The units of a job that a loss takes whole, and how the global batch is split over
    them: each rank, or with a mesh each index of the data-parallel mesh's first axis."""

    def __init__(self, model: Any, sampler: Any) -> None:
        mesh = model.device_mesh
        self.root = None if mesh is None else mesh._get_root_mesh()
        if mesh is None or self.root is None:
            self.axis, self.commits = "", False
            return
        if not mesh.mesh_dim_names or not self.root.mesh_dim_names:
            raise UsageError("Recovery over a device mesh needs its axes named (mesh_dim_names)")
        self.axis = mesh.mesh_dim_names[0]
        if self.axis not in self.root.mesh_dim_names:
            raise UsageError(
                f"Recovery over a device mesh needs the data-parallel axes as a slice of the "
                f"root mesh (mesh['dp'] or mesh['dp', 'cp']), not the flattened {self.axis!r}"
            )
        self.dim = self.root.mesh_dim_names.index(self.axis)
        # other ranks than the data-parallel group's hold parts of the model (tensor parallel)
        self.commits = dist.get_world_size(model.process_group) < dist.get_world_size()
        self.check_sampler(sampler)

    def commit_steps(self, steps: OptimizerSteps, watch: RegroupWatch, timeout: timedelta) -> None:
        """Where the data-parallel group is not the whole job: each of the loop's optimizer
        steps begins with a commit, an all-reduce over every rank; the optimizer step then
        issues no collective, and a rank past the commit steps whatever happens to others."""
        if self.commits:  # the step's stamps alone: every rank reached it
            steps.commit = lambda n: stamped_barrier(n, watch, timeout)

    def share(self, me: Membership) -> tuple[int, int]:
        """``(num_replicas, rank)`` for the sampler: this rank's replica among the replicas."""
        if self.root is None:
            return me.world_size, me.rank
        return self._replica()

    def _replica(self) -> tuple[int, int]:
        assert self.root is not None
        return self.root.size(self.dim), self.root.get_local_rank(self.axis)

    def check_sampler(self, sampler: Any) -> None:
        """On a mesh: :class:`UsageError` unless ``sampler`` splits over the replicas."""
        if self.root is None:
            return
        want = self._replica()
        if (sampler.num_replicas, sampler.rank) != want:
            raise UsageError(
                f"Recovery splits each global batch over the {want[0]} replicas of mesh axis "
                f"{self.axis!r}, each rank of a replica reading the same share: build the "
                "GlobalBatchSampler "
                f"with num_replicas={want[0]}, rank={want[1]} (got num_replicas="
                f"{sampler.num_replicas}, rank={sampler.rank})"
            )

    def lost_inside(self, exc: BaseException, begun: Callable[[], bool], window: float) -> bool:
        """Whether ``exc``, which ended a step, is a peer lost inside a replica: a collective
        of the model's own (tensor or context parallel, issued by DTensor or the model on a
        mesh group, which gradsync does not wait for) raises gloo's plain ``RuntimeError``.
        It is taken for a loss once a survivor begins to regroup, within ``window`` seconds;
        any other error, or none begun, goes on up unchanged."""
        if self.root is None or type(exc) is not RuntimeError:
            return False
        give_up = time.monotonic() + window
        while not begun():
            if time.monotonic() > give_up:
                return False
            time.sleep(0.01)
        return True

    def inner_groups(self) -> list[dist.ProcessGroup]:
        """The mesh's groups inside one replica (the axes but the replicas', and flattened
        meshes of them), taken out of the mesh: this rank's peers in them all live, and one
        may be waiting in their collective for this rank, now regrouping. Destroyed rather than
        kept (``close_groups``), they close their connections, and the peer's wait raises."""
        if self.root is None:
            return []
        root, registry = self.root, self.root._pg_registry
        names = [n for i, n in enumerate(root._dim_group_names) if i != self.dim]
        for flat, axes in flattened_axes(root).items():
            if self.axis not in axes:
                names.append(root._flatten_mapping[flat]._dim_group_names[0])
        return [registry.pop(n) for n in names if n in registry]

    def left_after(self, lost: set[int], members: int) -> int:
        """How many replicas the ``members`` left after losing ``lost`` (ranks of the current
        group) form; :class:`NoRecoveryError` unless ``lost`` is whole replicas."""
        if self.root is None:
            return members
        check_whole(self.root.mesh, self.dim, self.axis, lost)
        return members * self.root.size(self.dim) // self.root.mesh.numel()

    def regroup(self, members: tuple[int, ...]) -> None:
        """After the new default group of ``members`` (ranks before, in new rank order): the
        mesh laid out again over them, in place ([Note: a mesh rebuilt in place])."""
        if self.root is not None:
            rebuild_in_place(self.root, survivors_layout(self.root.mesh, self.dim, members))


def check_whole(ranks: torch.Tensor, dim: int, axis: str, lost: set[int]) -> None:
    """:class:`NoRecoveryError` unless ``lost`` is whole replicas of the mesh laid out as
    ``ranks``, whose replicas are the indices of its axis ``dim`` (named ``axis``)."""
    for index, replica in enumerate(ranks.movedim(dim, 0)):
        held = set(replica.flatten().tolist())
        if held & lost and not held <= lost:
            raise NoRecoveryError(
                f"lost rank(s) {sorted(held & lost)} of replica {axis}={index} "
                f"(ranks {sorted(held)}) but not rank(s) {sorted(held - lost)}: on a "
                "device mesh a replica is recovered from only when lost whole (its "
                "ranks hold parts of one model, and the lost part is nowhere else)"
            )


def survivors_layout(ranks: torch.Tensor, dim: int, members: tuple[int, ...]) -> torch.Tensor:
    """The mesh laid out as ``ranks`` without the replicas (indices of axis ``dim``) that no
    member is in, each rank renumbered to its place in ``members``: every other axis, and
    every survivor's coordinates on it, unchanged."""
    new_rank = {old: new for new, old in enumerate(members)}
    kept = [r for r in ranks.movedim(dim, 0) if int(r.flatten()[0]) in new_rank]
    return torch.stack(kept).apply_(lambda r: new_rank[r]).movedim(0, dim)
