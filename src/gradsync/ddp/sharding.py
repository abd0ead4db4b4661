"""ZeRO-1 inside ``DistributedDataParallel``: the optimizer state sharded over the ranks, with
torch's contracts kept (``.grad``, ``clip_grad_norm_``, ``zero_grad``, the parameters after
``step()``).

[Note: sharded steps in the wrapper]
``opt = model.shard_optimizer(torch.optim.AdamW, lr=...)`` builds a :class:`ShardedOptimizer`
whose flat buckets are the wrapper's gradient buckets, parameter for parameter, padded to equal
slices (``optim/layout.py``): each rank keeps the optimizer state of its slice only. It has the
shape of torch's ``ZeroRedundancyOptimizer`` under torch's DDP, which is what a training loop
written for torch expects of it:

1. Backward: the buckets are all-reduced as without sharding (the same comm hook, overlapped
   with backward), and every rank gets the full reduced gradient in ``.grad``: the reducer
   does exactly what it does without sharding, and knows nothing of it.
2. ``opt.step()``: one small all-reduce checks that every rank is about to step alike (the
   same hyper-parameters, the same parameters holding a ``.grad``; see [Note: optimizer
   settings agree across ranks] in ``optim/agree.py``); then, bucket by bucket, the inner
   optimizer steps this rank's slices from ``.grad`` and the bucket's parameter all-gather is
   started at once, overlapping the step of the next bucket; ``step()`` returns once every
   gather has landed.

So the torch idioms mean what they mean without sharding. ``torch.nn.utils.clip_grad_norm_(
model.parameters(), max_norm)`` reads the full reduced ``.grad`` and clips it by the global
norm, the same on every rank, and the step reads the clipped ``.grad``. ``opt.zero_grad()`` or
``model.zero_grad()`` after backward leaves nothing to step, as with torch (a ``.grad`` of
``None`` is skipped; cleared on some ranks only, the check refuses the step on every rank).
``model.module.state_dict()`` and ``model.module.parameters()`` right after ``step()`` hold the
stepped weights on every rank: nothing is left in flight that a read of the module, which the
wrapper cannot intercept, would race with.

What it costs (figures and method in ``docs/zero.md``): the gradients travel as without
sharding, plus one all-gather of the parameters, ``(d-1)/d`` of them: 1.5x the bytes of plain
data parallelism, as torch's ZeRO. The first design (reduce-scatter in backward, ``.grad`` left
``None``, the gathers waited for in the next forward's pre-hooks) sent 1.0x but broke all three
idioms silently: torch's clip saw no gradient and returned 0, ``zero_grad()`` did not clear the
reduce-scattered shards, and the module's parameters were stale (and different on each rank)
until the next forward through the wrapper. Measured side by side (2 ranks, GPT 7.1M, AdamW):
the step costs what the first design's did where compute hides the wire (0.97x on loopback,
1.00x at 1 Gbit/s; the per-bucket overlap is worth 1.04-1.18x), and 1.28x on a 250 Mbit/s link
(still 0.74x torch's ZeRO). A mode keeping the 1.0x would have to make those idioms fail loudly
(a ``.grad`` whose every operation raises), not work; its saving is bytes, not memory: with
``gradient_as_bucket_view=True`` the full ``.grad`` costs nothing beyond the buckets, and the
optimizer state, the point of ZeRO-1, is sharded either way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommStats, Handle
from gradsync.comm.ring import Ring, RingRunner, group_ring
from gradsync.comm.worker import SerialWorker
from gradsync.ddp.checks.verdicts import per_rank_lines
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.owners import deadline_peers
from gradsync.ddp.plan import BucketSpec
from gradsync.errors import GradsyncError, ParametersChangedError, ProtocolError, UsageError
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout
from gradsync.optim import agree, clip
from gradsync.optim.buffers import FlatBucket
from gradsync.optim.sharded import ShardedOptimizer


class _Gather:
    """How the stepped parameters travel: one all-gather per bucket of every rank's slice.

    On gloo it runs on gradsync's ring (``comm/ring.py``) on a worker thread, because gloo's own
    collectives move more bytes than the ring bound (measured over a 1 Gbit/s link, 28 MB, 2
    ranks: all_gather 163 ms, reduce_scatter 251 ms, all_reduce 234 ms, where the ring bound of
    each half is 112 ms). Other backends (NCCL) use their own ``all_gather_into_tensor``.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.native = dist.get_backend(group) != "gloo"
        self.stats = CommStats()  # the ring's count of the bytes it sent (gloo)
        if not self.native and self.world_size > 1:
            ring = group_ring(group)
            # Rotated by one, so that rank p starts from slice p (the ring's chunk p + 1), as
            # the optimizer's layout has it.
            shifted = ring.ranks[1:] + ring.ranks[:1]
            self.ring = Ring(group, shifted, (ring.index - 1) % ring.size)
            self.runner = RingRunner(self.stats)
            self.worker = SerialWorker("gradsync-zero")

    def start(self, bucket: FlatBucket) -> Handle | None:
        """Start gathering every rank's slice of ``bucket`` into its flat buffer (``None``:
        one rank, nothing to gather)."""
        if self.world_size == 1:
            return None
        flat = bucket.data
        if self.native:
            return dist.all_gather_into_tensor(flat, bucket.shard, group=self.group, async_op=True)
        return self.worker.submit(lambda: self.runner.all_gather(flat, self.ring))


class Counted(Protocol):
    """The reducer, as the sharded steps see it: one step per synchronised backward."""

    num_reductions: int


class ShardedSteps:
    """The wrapper's side of a sharded optimizer: each step runs under the wrapper's deadline,
    from the reduced gradients the reducer left in ``.grad``."""

    def __init__(
        self,
        optimizer: ShardedOptimizer,
        deadline: Deadline,
        peers: agree.Peers,
        reducer: Counted,
    ) -> None:
        assert deadline.group is not None
        self.optimizer = optimizer
        self.deadline = deadline
        self.peers = peers
        # Weakly: the optimizer, which holds these steps, may outlive the wrapper.
        self._reducer = weakref.ref(reducer)
        self._stepped_after: int | None = None  # reductions when the last step completed
        self.gather = _Gather(deadline.group)
        self._in_flight: list[Any] = []  # all-gathers of a step that raised before its wait
        self._step = 0
        # Ranks out of data inside ``model.join(optimizer)`` (the wrapper's join protocol sets
        # it): they step their slices without the active ranks' clip.
        self.waiting: Callable[[], int] = lambda: 0
        optimizer.attach(self)

    def reductions(self) -> int:
        """The synchronised backwards of the wrapper's reducer so far."""
        reducer = self._reducer()
        if reducer is None:
            raise ProtocolError("a sharded optimizer's wrapper was deleted: it cannot step")
        return reducer.num_reductions

    @torch.no_grad()
    def step(self) -> None:
        """Check that every rank steps alike, step each bucket's slices from ``.grad`` and
        all-gather it, overlapped with the next bucket's step; return once all have landed."""
        d = self.deadline
        self.wait_all()
        d.begin(f"the sharded optimizer's step {self._step + 1}")
        try:
            reductions = self.reductions()
            if reductions == self._stepped_after:  # before any collective: see step_again
                raise step_again(d.rank, self._step)
            self.optimizer.check_step(self.peers)
            mirror = self.optimizer.mirror
            start = self.gather.start if mirror is None else mirror.around(self.gather.start)
            self._in_flight = self.optimizer.step_and_gather(start)
            if mirror is not None:
                mirror.step()  # while every gather is under way (gradsync.recovery)
            self._step += 1
            self._stepped_after = reductions
            if mirror is not None:
                mirror.stepped()  # every slice this rank holds has stepped
            self.wait_all()
            if mirror is not None:
                mirror.compare()
        except GradsyncError as exc:
            d.record_error(exc)  # so that a peer's timeout can name it
            raise

    def regroup(self, deadline: Deadline, peers: agree.Peers) -> None:
        """Go on over ``deadline``'s group (``gradsync.recovery``), once the optimizer's slices
        were cut again for its size (``recovery/recut.py``)."""
        if self.optimizer.world_size != deadline.world_size:
            raise UsageError(
                f"the sharded optimizer's slices are cut for {self.optimizer.world_size} ranks, "
                f"the new group has {deadline.world_size}: ZeRO-1 goes on over a new group only "
                "through Recovery's re-cut of its state"
            )
        assert deadline.group is not None
        self.deadline, self.peers, self._stepped_after = deadline, peers, None
        self.optimizer.process_group = deadline.group
        self.gather = _Gather(deadline.group)

    def count_step(self) -> None:
        """A step of this rank's slices taken outside :meth:`step` (a survivor that had not
        stepped takes a step's result: ``recovery/recut.py``)."""
        self._step += 1

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``.grad`` by its norm as ``torch.nn.utils.clip_grad_norm_`` does: every rank
        holds the same reduced gradients, so that norm is the global one (no collective), and
        summed in the parameters' order whatever N ([Note: ZeRO-1 in the deterministic mode]
        in ``deterministic.py``)."""
        waiting = self.waiting()
        if waiting:
            exc = UsageError(
                f"clip_grad_norm_ of a sharded optimizer inside join(), in a step where "
                f"{waiting} rank(s) ran out of data: those step their slices of the same "
                "gradients unclipped, so every rank would end with parameters no single "
                "process computes. Clip only the steps every rank runs (skip the short last "
                "one), or pass drop_last=True to the sampler"
            )
            self.deadline.record_error(exc)  # the waiting ranks' deadline names it
            raise exc
        grads = [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        total = clip.total_norm(grads, norm_type)
        clip.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def wait_all(self) -> None:
        """Wait for all-gathers left in flight (only by a step that raised: ``step`` returns
        with the parameters in place)."""
        pending, self._in_flight = self._in_flight, []
        for index, work in enumerate(pending):
            if work is None:
                continue
            # On NCCL the stream waits, not the host (a wait with a timeout would hold the host
            # until the GPU is done); the next step's readout is under the deadline instead
            # (see [Note: a deadline for NCCL] in deadline.py).
            what = f"the all-gather of bucket {index}'s parameters"
            self.deadline.wait(work, what, host_deadline=not self.gather.native)

    def updates(self) -> int:
        """Optimizer steps taken: the same on every rank (for the step tags)."""
        return self._step


def step_again(rank: int, steps: int) -> ProtocolError:
    """A second ``opt.step()`` with no synchronised backward since the last one: every step
    is a collective (a check, then all-gathers), so on one rank alone (a retry after a caught
    exception) its collectives would pair with the others' next forward and backward, and the
    backend aborts the process. Refused before the first collective, so the others' deadline
    names this error instead of a lost peer."""
    return ProtocolError(
        f"opt.step() of the sharded optimizer ran again on rank {rank} with no synchronised "
        f"backward since its step {steps}: under shard_optimizer() every rank steps once per "
        "synchronised backward, together (a step is a collective). If a step raised, do not "
        "retry it on one rank; skip the step on every rank (opt.zero_grad()) or stop"
    )


def refuse_unsupported(
    options: SyncOptions, layouts: Sequence[GradLayout | None], torch_hook: bool
) -> None:
    """Raise ``UsageError`` naming every setting of a wrapper (``options``, its parameters'
    DTensor ``layouts``, a registered ``torch_hook``) that ZeRO-1 does not support."""
    settings = {
        "main_grad_dtype": options.main_grad_dtype is not None,
        "algorithm": options.all_reduce.name != "native",
        "compression": options.compression is not None or torch_hook,
        "check_finite": options.check_finite,
        "DTensor parameters": any(layout is not None for layout in layouts),
        # The optimizer's layout follows the buckets, which "auto" replaces after a few steps.
        "bucket_cap_mb='auto'": options.auto,
    }
    bad = [name for name, on in settings.items() if on]
    if bad:
        raise UsageError(f"shard_optimizer() does not support {', '.join(bad)} yet")


def shard(
    specs: Sequence[BucketSpec],
    named: Sequence[tuple[str, nn.Parameter]],
    changes: list[str],
    deadline: Deadline,
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    reducer: Counted,
) -> ShardedSteps:
    """The sharded steps of ``DistributedDataParallel.shard_optimizer``: a
    :class:`ShardedOptimizer` over the parameters ``named`` (the reducer's) whose flat buckets
    are the wrapper's ``specs``. A collective: every rank must call it. ``changes``: how this
    rank's parameter set differs from wrapping time."""
    _refuse_changed_parameters(changes, deadline)
    params = [p for _, p in named]
    buckets = [[params[i] for i in spec.param_indices] for spec in specs]
    opt = ShardedOptimizer(
        params, optimizer_class, process_group=deadline.group, buckets=buckets, **defaults
    )
    names = {id(p): name for name, p in named}
    return ShardedSteps(opt, deadline, deadline_peers(deadline, names), reducer)


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
