"""ZeRO-1 inside ``DistributedDataParallel``: gradients reduce-scattered into each rank's shard
during backward, updated parameters all-gathered while the next forward runs.

[Note: sharded steps in the wrapper]
``opt = model.shard_optimizer(torch.optim.AdamW, lr=...)`` builds a :class:`ShardedOptimizer`
whose flat buckets are the wrapper's gradient buckets, parameter for parameter, padded to equal
slices (``optim/layout.py``). Then, per bucket:

1. Backward: when the bucket is full, a ``reduce_scatter`` leaves on each rank the sum of its
   own slice only (pre-divided as the reduction says, like the all-reduce it replaces), and an
   exact ``all_reduce`` of the bucket's tail (used flags and step tags, a few numbers per
   parameter) keeps every check of the reducer working unchanged.
2. ``opt.step()``: the inner optimizer steps this rank's slices from those shards, then one
   ``all_gather`` per bucket is *started* and the step returns.
3. Next forward: a forward pre-hook on each module waits for the all-gathers of the buckets
   holding its parameters, just before it runs, so the gathers of later layers overlap the
   forward of earlier ones (Megatron-LM's ``overlap_param_gather``).

Bytes per rank: the reduce-scatter and the all-gather each move ``(d-1)/d`` of the bucket, the
same ``2(d-1)/d`` as the ring all-reduce they replace. ``.grad`` is left ``None`` after a sharded
backward: the full reduced gradient exists nowhere (that is the memory saving), and this
rank's local gradient must not be mistaken for it; clip with ``opt.clip_grad_norm_``. Anything
that reads parameters between ``step()`` and the next forward (``state_dict()``,
``check_replicas()``, a checkpoint) waits for the gathers first: :meth:`GradientShards.wait_all`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommHook, CommStats, Handle
from gradsync.comm.hook import BucketLike, tail
from gradsync.comm.ring import Ring, RingRunner, group_ring
from gradsync.comm.worker import SerialWorker
from gradsync.ddp.checks.verdicts import per_rank_lines
from gradsync.ddp.plan import BucketSpec
from gradsync.errors import ParametersChangedError
from gradsync.failfast.deadline import Deadline
from gradsync.optim import clip
from gradsync.optim.sharded import ShardedOptimizer


class _Both:
    """The handle of a bucket's two native collectives (its slice and its exact tail)."""

    def __init__(self, *works: Any) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True


class _Wire(CommHook):
    """How shards travel. Bucket ``i``: its gradients reduce-scattered (this rank's slice summed
    into ``grad_shards[i]``), its tail all-reduced exactly; after the step, each bucket's
    parameters all-gathered.

    On gloo both halves run on gradsync's ring (``comm/ring.py``), because gloo's own
    ``reduce_scatter`` moves as many bytes as a whole all-reduce (measured over a 1 Gbit/s link,
    28 MB, 2 ranks: reduce_scatter 251 ms, all_reduce 234 ms, all_gather 163 ms, where the ring
    bound of each half is 112 ms), which would make ZeRO cost 1.8x the bytes of plain data
    parallelism. The ring's reduce-scatter sums in place, so there ``grad_shards[i]`` is this
    rank's slice of the bucket itself. Other backends (NCCL) use their own collectives.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.native = dist.get_backend(group) != "gloo"
        self.stats = CommStats()
        self.grad_shards: list[torch.Tensor] = []
        if not self.native:
            ring = group_ring(group)
            # Rotated by one, so that the reduce-scatter leaves rank p with slice p (the ring
            # itself leaves rank p with chunk p + 1), as the optimizer's layout wants.
            shifted = ring.ranks[1:] + ring.ranks[:1]
            self.ring = Ring(group, shifted, (ring.index - 1) % ring.size)
            self.runner = RingRunner(self.stats)
            self.worker = SerialWorker("gradsync-zero")

    def bind(self, buckets: Sequence[BucketLike], optimizer: ShardedOptimizer) -> None:
        """Where each bucket's reduced slice lands (see the class docstring)."""
        for bucket, flat in zip(buckets, optimizer.buckets, strict=True):
            lo, hi = flat.layout.rank_range(optimizer.rank)
            native = torch.empty_like(flat.shard)
            self.grad_shards.append(native if self.native else bucket.grads[lo:hi])

    def start(self, bucket: BucketLike) -> Handle:
        grads, exact = bucket.grads, tail(bucket)  # grads: padded to the equal slices
        if self.native:
            out = self.grad_shards[bucket.spec.index]
            scatter = dist.reduce_scatter_tensor(out, grads, group=self.group, async_op=True)
            return _Both(scatter, dist.all_reduce(exact, group=self.group, async_op=True))

        def job() -> None:
            if self.ring.size > 1:
                self.runner.reduce_scatter(grads, self.ring)
                self.runner.all_reduce(exact, self.ring)

        return self.worker.submit(job)

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor) -> Handle | None:
        """Start gathering every rank's ``shard`` into ``flat`` (``None``: one rank)."""
        if dist.get_world_size(self.group) == 1:
            return None
        if self.native:
            return dist.all_gather_into_tensor(flat, shard, group=self.group, async_op=True)
        return self.worker.submit(lambda: self.runner.all_gather(flat, self.ring))


class GradientShards:
    """This rank's shard of every bucket's reduced gradient, and the parameter all-gathers."""

    def __init__(self, optimizer: ShardedOptimizer, deadline: Deadline, module: nn.Module) -> None:
        assert deadline.group is not None
        self.optimizer = optimizer
        self.deadline = deadline
        self.padded_numels = [b.layout.padded_numel for b in optimizer.buckets]
        self.hook = _Wire(deadline.group)
        self.grad_shards = self.hook.grad_shards  # filled by bind() once the buckets exist
        self._unused: list[torch.Tensor] = []  # no gradient on any rank this step: not stepped
        self._gathers: list[Any] = []  # per bucket, until waited for (None: done)
        self._step = 0
        bucket_of = {id(p): b.index for b in optimizer.buckets for p in b.params}
        self._hooks = []
        for m in module.modules():
            mine = sorted(
                {bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of}
            )
            if mine:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(mine)))
        optimizer.attach(self)

    def receive(self, buckets: Sequence[Any], counts: Sequence[Sequence[float]]) -> None:
        """After a sharded reduction: note what to skip and clear ``.grad`` (see the Note)."""
        self._unused = [
            p
            for b, c in zip(buckets, counts, strict=True)
            for p, n in zip(b.params, c, strict=True)
            if n == 0
        ]
        for b in buckets:
            for p in b.params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's slices from the reduced shards; start the parameter all-gathers."""
        self.wait_all()
        self.optimizer.step_from_shards(self.grad_shards, skip=self._unused)
        self._step += 1
        self._gathers = [self.hook.all_gather(b.data, b.shard) for b in self.optimizer.buckets]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradient by its global norm, from the shards (padding is zero)."""
        self.wait_all()  # a gather still running for a bucket no forward used yet
        total = clip.total_norm(
            list(self.grad_shards), norm_type, process_group=self.deadline.group,
            device=self.grad_shards[0].device,
        )  # fmt: skip
        clip.clip_grads_with_norm_(list(self.grad_shards), max_norm, total)
        return total

    def wait_bucket(self, index: int) -> None:
        if index < len(self._gathers) and self._gathers[index] is not None:
            work = self._gathers[index]
            self._gathers[index] = None
            assert work is not None
            self.deadline.wait(work, f"the all-gather of bucket {index}'s parameters")

    def wait_all(self) -> None:
        for index in range(len(self._gathers)):
            self.wait_bucket(index)

    def _waiter(self, indices: list[int]) -> Callable[..., None]:
        def wait_before_forward(module: nn.Module, args: Any) -> None:
            for index in indices:
                self.wait_bucket(index)

        return wait_before_forward

    def updates(self) -> int:
        """Optimizer steps taken: the same on every rank (for the step tags)."""
        return self._step


def shard(
    specs: Sequence[BucketSpec],
    params: Sequence[nn.Parameter],
    changes: list[str],
    deadline: Deadline,
    module: nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
) -> GradientShards:
    """The gradient shards of ``DistributedDataParallel.shard_optimizer``: a
    :class:`ShardedOptimizer` over ``params`` (the reducer's) whose flat buckets are the
    wrapper's ``specs``, and the wire that fills them. A collective: every rank must call it.
    ``changes``: how this rank's parameter set differs from wrapping time."""
    _refuse_changed_parameters(changes, deadline)
    buckets = [[params[i] for i in spec.param_indices] for spec in specs]
    opt = ShardedOptimizer(
        params, optimizer_class, process_group=deadline.group, buckets=buckets, **defaults
    )
    return GradientShards(opt, deadline, module)


def _refuse_changed_parameters(changes: list[str], deadline: Deadline) -> None:
    """Raise on every rank if the parameter set changed since wrapping on some rank: the
    shards are cut from the wrapping-time buckets, and ``requires_grad`` flipped on one rank
    would build an optimizer that the others do not have (a collective: one gather)."""
    what = "the parameter check of shard_optimizer()"
    deadline.begin(what)
    lines = per_rank_lines(changes, deadline, what)
    if lines:
        raise ParametersChangedError(
            "shard_optimizer(): the module's parameters changed after it was wrapped, and its "
            f"shards are cut from the buckets planned at wrapping:\n{lines}\nMake such changes "
            "before wrapping, or wrap again after them on every rank"
        )
