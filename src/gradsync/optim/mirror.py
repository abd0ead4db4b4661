"""A buddy's mirror of its neighbour's slices of a ZeRO-1 optimizer's state, kept current by
stepping it, not by copying it.

[Note: a mirror of the neighbour's slices]
Under ZeRO-1 the optimizer state of a rank's slices exists on that rank only: lose the rank and
the state is gone (``gradsync.recovery`` could not redo the step exactly). So each rank ``r``
also keeps the state of rank ``(r + 1) % N``'s slices (it is that rank's *buddy*), in a second
inner optimizer of the same class and hyper-parameters over buffers of its own. Every rank
holds the full reduced gradient in ``.grad`` when the sharded step begins ([Note: sharded steps
in the wrapper] in ``ddp/sharding.py``), so the buddy steps its mirror from the same inputs as
the owner steps the slice: the parameters at the step's start (copied from the flat buffer
before that bucket's all-gather overwrites them), the same gradient elements, the same state,
the same hyper-parameters, the same pieces in the same param groups. An elementwise optimizer
then gives the same bits, with no extra bytes on the wire: one more slice step per rank (``1/N``
more optimizer compute, while the gathers are under way: [Note: when the mirror steps]) and
``2/N`` of the state per rank instead of ``1/N``, where the alternative (sending the state after
every step) would move the whole state once per step.

The claim "the same bits" is checked, not assumed: once a step's gathers have landed, the
mirror's stepped parameters are compared with the owner's, gathered into the flat buffer, bit
for bit (one comparison of a slice: :func:`same_bits`). A difference (an optimizer that is not
elementwise, or not deterministic) refuses the next step on every rank, naming the bucket and
the ranks, instead of leaving a mirror that would silently make a later recovery inexact.

A mirror starts from the owner's state (:meth:`Mirror.sync`, one object all-gather) when it is
made, and again whenever the owner's state is loaded from a checkpoint.

[Note: when the mirror steps]
The owner's step is a chain: step a bucket's slice, start its all-gather, step the next. The
mirror's step is on no chain (nothing waits for it but the end of ``step()``), so it runs after
the last bucket's gather has started, while the gathers are under way, in one call of the
mirror's optimizer over every bucket's mirrored slices. Stepped bucket by bucket between the
owner's (until 2026-12), it held back the start of every later bucket's gather by the mirror's
step of the buckets before, on every rank (a ring gather waits for its slowest member), and
paid the optimizer's per-call work (its look at every slice for a gradient) once per bucket
(measured in ``benchmarks/2026-12-07-zero-recovery-cost.md``). The one call changes no bit: an
elementwise optimizer updates an element from that element's gradient, state and
hyper-parameters alone, whichever tensors share the call (and the comparison would say if it
did not). What stays is the copy of the step's start, taken just before each bucket's gather
starts (the last moment it is in the flat buffer), the mirror's optimizer step itself (as much
compute as the owner's), and the comparison.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

try:
    import numpy as np
except ImportError:  # an optional dependency of torch: torch.equal instead
    np = None  # type: ignore[assignment]

from gradsync.errors import ProtocolError
from gradsync.optim.buffers import FlatBucket
from gradsync.optim.state import hyperparameters


class Mirrored(Protocol):
    """What a mirror reads of the :class:`~gradsync.optim.ShardedOptimizer` it mirrors."""

    optimizer_class: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]
    buckets: list[FlatBucket]
    optim: torch.optim.Optimizer
    rank: int
    world_size: int

    @property
    def steps(self) -> int: ...


class MirrorBucket:
    """The mirror of one rank's slice of one flat bucket: a buffer of its own, the slice's
    pieces, and the 1-D views of the buffer that the mirror's optimizer steps."""

    def __init__(self, bucket: FlatBucket, rank: int) -> None:
        self.bucket, self.rank = bucket, rank
        self.lo, self.hi = bucket.layout.rank_range(rank)
        self.shard = bucket.data[self.lo : self.hi].clone()
        self.pieces = bucket.layout.pieces(rank)
        self.slices = [
            self.shard[pc.shard_offset : pc.shard_offset + pc.numel] for pc in self.pieces
        ]

    def take(self) -> None:
        """The owner's parameters, as they are in the flat buffer now."""
        self.shard.copy_(self.bucket.data[self.lo : self.hi])

    def attach_param_grads(self) -> None:
        for pc, s in zip(self.pieces, self.slices, strict=True):
            grad = self.bucket.params[pc.param].grad
            s.grad = None if grad is None else grad.reshape(-1)[pc.start : pc.end]

    def detach_grads(self) -> None:
        for s in self.slices:
            s.grad = None

    def same_as_owner(self) -> bool:
        return same_bits(self.shard, self.bucket.data[self.lo : self.hi])


class Mirror:
    """Rank ``r``'s mirror of rank ``(r + 1) % N``'s slices of ``opt`` ([Note: a mirror of the
    neighbour's slices]); nothing to mirror in a group of one."""

    def __init__(self, opt: Mirrored) -> None:
        self.opt = opt
        self.stepped: Callable[[], None] = lambda: None  # called once a step's slices stepped
        self.build()

    def build(self) -> None:
        """Lay the mirror out for the optimizer's current layout (empty state)."""
        opt = self.opt
        self.neighbour = (opt.rank + 1) % opt.world_size
        self.on = opt.world_size > 1
        self.buckets = [MirrorBucket(b, self.neighbour) for b in opt.buckets] if self.on else []
        self.diverged: str | None = None
        accepted = inspect.signature(opt.optimizer_class.__init__).parameters
        defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
        self.optim = opt.optimizer_class([{"params": []}], **defaults)
        self.optim.param_groups.clear()
        # The owner's inner groups, in the owner's order: the neighbour's own optimizer has
        # these slices in this order, so its state dict loads here as it is.
        for g in opt.param_groups:
            mine = {id(p) for p in g["params"]}
            slices = [
                s
                for mb in self.buckets
                for pc, s in zip(mb.pieces, mb.slices, strict=True)
                if id(mb.bucket.params[pc.param]) in mine
            ]
            self.optim.add_param_group({**hyperparameters(g), "params": slices})

    # -- stepping, inside the owner's sharded step ---------------------------------------------
    def around(self, start: Callable[[FlatBucket], Any]) -> Callable[[FlatBucket], Any]:
        """``start`` (a bucket's all-gather), with the neighbour's parameters at the step's start
        taken first: the gather overwrites them. The mirror steps later (:meth:`step`)."""
        if not self.on:
            return start

        def take_then_start(b: FlatBucket) -> Any:
            self.buckets[b.index].take()
            return start(b)

        return take_then_start

    @torch.no_grad()
    def step(self) -> None:
        """Step every mirrored slice, in one call of the mirror's optimizer, once every
        bucket's all-gather has started ([Note: when the mirror steps])."""
        if not self.on:
            return
        for outer, inner in zip(self.opt.param_groups, self.optim.param_groups, strict=True):
            inner.update(hyperparameters(outer))
        for mb in self.buckets:
            mb.attach_param_grads()
        try:
            self.optim.step()
        finally:
            for mb in self.buckets:
                mb.detach_grads()

    def compare(self) -> None:
        """After a step's gathers have landed: note a mirror that differs from its owner."""
        for mb in self.buckets:
            if self.diverged is None and not mb.same_as_owner():
                self.diverged = (
                    f"rank {self.opt.rank}'s mirror of rank {self.neighbour}'s slice of bucket "
                    f"{mb.bucket.index} stepped to other values than rank {self.neighbour} did"
                )

    def check(self) -> None:
        """Raise (in the step's agreed checks: on every rank) if the mirror diverged."""
        if self.diverged is not None:
            raise ProtocolError(
                f"{self.diverged}: {self.opt.optimizer_class.__name__} did not give the same "
                "bits on the same inputs (not elementwise, or not deterministic), so a lost "
                "rank's optimizer state could not be recovered exactly; use an elementwise "
                "torch.optim optimizer, or run without Recovery"
            )

    # -- the state ---------------------------------------------------------------------------
    def sync(self, group: dist.ProcessGroup | None) -> None:
        """Start from the neighbour's own state (a collective over ``group``, the optimizer's).
        Transient: every rank receives every rank's state once, then keeps its neighbour's."""
        if not self.on:
            return
        opt = self.opt
        mine = opt.optim.state_dict()
        if opt.steps == 0:  # no step taken nor loaded: at most a placeholder, to load into
            mine = {**mine, "state": {}}
        everyone: list[Any] = [None] * opt.world_size
        dist.all_gather_object(everyone, mine, group=group)
        self.optim.load_state_dict(everyone[self.neighbour])
        for mb in self.buckets:
            mb.take()
        self.diverged = None

    def state_bytes(self) -> int:
        """Bytes of the mirror's optimizer state on this rank."""
        return state_bytes(self.optim)


def state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state."""
    return sum(
        v.numel() * v.element_size()
        for per_param in optim.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (1-D, one dtype) hold the same bits: a NaN equals the same NaN,
    ``-0.0`` differs from ``0.0``. Compared as integers, on the CPU by numpy when it is
    installed: its comparison is vectorised, ``torch.equal``'s was 5x slower there (0.13 ms
    against 0.7 ms for 1M float32)."""
    ints = _BITS.get(a.element_size(), torch.uint8)  # complex128: bytes
    a, b = a.view(ints), b.view(ints)
    if a.device.type == "cpu" and np is not None:
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return torch.equal(a, b)
