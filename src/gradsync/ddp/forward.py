"""What a forward through the wrapper does before its module runs.

[Note: the forward protocol]
Every forward through :class:`~gradsync.DistributedDataParallel` takes these steps, in this
order, before the module runs (:meth:`ForwardProtocol.run`). Those marked * are collectives:
every rank must issue them in the same order, and does, because every rank runs the same
sequence of training forwards (the step tags check it after each step) and each condition below
is the same on every rank. Forwards in eval mode issue none: an evaluation may run on rank 0
alone.

     step                                                   runs when
  1    the inputs to the replica's device                   device_ids was given
  2    stop here                                            grad is disabled (torch.no_grad())
  3 *  tell torch's Join this rank is still active          training, inside torch's Join
  4    refuse a forward the lifecycle forbids               always (failed, retired, or
                                                            inside a synchronised backward)
  5 *  "auto" buckets: profile, agree, switch plans         training, bucket_cap_mb="auto",
                                                            between steps, outside join
  6    plan the first step's unused parameters last         training, between steps, outside
                                                            join, once
  7    begin an operation under the deadline                training, when any of 8-11 runs
  8 *  compare the first batches (a fingerprint)            the first training forward
  9 *  compare the replicas' checksums                      every check_replicas_every steps
 10 *  the join handshake: how many ranks have data         training, inside join (in the
                                                            deterministic mode: synchronised
                                                            forwards only)
 11 *  broadcast rank 0's buffers                           training, broadcast_buffers, and
                                                            the module has buffers
 12    open or continue the step window; decide sync        always
 13    mark the forward's start on the step timeline        training

Steps 5 and 6 may lay the reducer's buckets out again (``Reducer.replan``); steps 8-12 use the
buckets in place after them. The handshake comes after the checks of a step's first forward so
that it is at the same place in the deterministic mode, where a rank's first and synchronised
forwards may be one forward or two ([Note: leaves and join] in ``deterministic.py``). A
:class:`~gradsync.errors.GradsyncError` raised on the way is left in this rank's arrival
record, so that a peer's timeout names it. The wrapper's lifecycle, which step 4 reads, is the
state's ([Note: the wrapper's lifecycle] in ``state.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed.algorithms.join import Join, Joinable

from gradsync.ddp.checks.diagnostics import warn_if_same_batch
from gradsync.ddp.compat import torch_args
from gradsync.ddp.join import JoinProtocol
from gradsync.ddp.lifecycle import Lifecycle
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.replan.autotune import AutoBuckets
from gradsync.ddp.replan.unused_last import UnusedLast
from gradsync.errors import GradsyncError, ProtocolError
from gradsync.failfast.deadline import Deadline
from gradsync.timing import StepTimeline


class ForwardState(Protocol):
    """What the forward protocol acts on: the wrapper's state (``state.py``), as it sees it."""

    deadline: Deadline
    reducer: Reducer
    join: JoinProtocol
    timeline: StepTimeline
    bucket_sizes: list[tuple[int, torch.dtype]]  # as the buckets hold the gradients
    bucket_cap_mb: float | None  # the cap the buckets in use were planned with

    @property
    def lifecycle(self) -> Lifecycle: ...

    def adopt_plan(self, specs: list[BucketSpec], cap_mb: float | None) -> None: ...

    def plan_last(self, last: tuple[int, ...]) -> None: ...

    def check_replicas(self) -> None: ...

    def broadcast_buffers(self, src: int = 0) -> None: ...


class ForwardProtocol:
    """The steps of [Note: the forward protocol], and what they keep between forwards: whether
    a training forward ran, whether the first batches were compared, the last replica check,
    and the two re-planners that act at step boundaries. Each call is handed the wrapper's
    state, which it acts on."""

    def __init__(
        self, options: SyncOptions, inputs_to: torch.device | None, batches_compared: bool = False
    ) -> None:
        self.inputs_to = inputs_to  # step 1: the replica's device, with device_ids
        self.check_every = options.check_replicas_every
        self.autotune = AutoBuckets(options.first_bucket_cap_mb) if options.auto else None
        self.unused_last = UnusedLast(options)
        self.replicas_checked_at = 0  # the step of the last check_replicas_every check
        self.trained = False  # a forward with grad enabled ran: no longer configurable
        self.batches_compared = batches_compared  # step 8 ran (once a job, not once a group)

    def refuse_unless_usable(self, state: ForwardState) -> None:
        """Step 4: raise if a forward now would break the protocol, before any collective."""
        lifecycle = state.lifecycle
        if lifecycle is Lifecycle.FAILED:
            state.deadline.check_usable()  # raises, saying what failed
        if lifecycle is Lifecycle.RETIRED:
            by = state.reducer.retired_by
            raise ProtocolError(
                "this DistributedDataParallel no longer synchronises anything: its module's "
                f"parameters were wrapped again{f' ({by})' if by else ''}, and the newer "
                "wrapper took them over. A module is wrapped once: use the newer wrapper, or "
                "remove the second wrap"
            )
        if state.reducer.reducing:
            raise ProtocolError("forward called while a synchronised backward is still running")

    def run(
        self,
        state: ForwardState,
        joinable: Joinable,
        args: Any,
        kwargs: Any,
        *,
        training: bool,
        sync: bool,
        broadcast: bool,
    ) -> tuple[Any, Any]:
        """Steps 1-13 for one forward through ``joinable`` (the wrapper); returns the inputs to
        run the module with. ``sync``: ``require_backward_grad_sync``; ``broadcast``: buffers
        are broadcast (step 11)."""
        if self.inputs_to is not None:  # 1: torch's rule, inputs go to the replica's device
            args, kwargs = torch_args.to_device((args, kwargs), self.inputs_to)
        if not torch.is_grad_enabled():  # 2: nothing to synchronise
            return args, kwargs
        self.trained = True
        if training:  # 3: torch's Join counts the ranks still active (join_hook())
            Join.notify_join_context(joinable)
        joining = state.join.joining(joinable)
        try:
            self.refuse_unless_usable(state)  # 4
            if training:
                self._replan(state, joining)  # 5, 6
            batch = (args, kwargs)
            num_active = self._collectives(state, training, sync, broadcast, joining, batch)
            by_world = state.join.divides_by_world
            state.reducer.begin_forward(sync, training, num_active, by_world)  # 12
            if training:
                state.timeline.recorder.forward_began()  # 13
        except GradsyncError as exc:
            state.deadline.record_error(exc)  # so that the peers' timeout can name it
            raise
        return args, kwargs

    def _replan(self, state: ForwardState, joining: bool) -> None:
        """Steps 5 and 6: at a step boundary, the buckets may be planned anew."""
        reducer = state.reducer
        if self.autotune is not None:  # decides by itself whether this is a step boundary
            sizes, cap_mb = state.bucket_sizes, state.bucket_cap_mb
            self.autotune.before_forward(reducer, joining, sizes, cap_mb, state.adopt_plan)
        if not (reducer.window_open or joining):  # between steps
            self.unused_last.before_forward(reducer.first_unused, state.plan_last)

    def _collectives(
        self,
        state: ForwardState,
        training: bool,
        sync: bool,
        broadcast: bool,
        joining: bool,
        batch: Any,
    ) -> int | None:
        """Steps 7-11; returns how many ranks still have data inside join (``None``: all)."""
        steps = state.reducer.num_reductions
        every = self.check_every
        check_due = every and steps and steps % every == 0 and self.replicas_checked_at != steps
        first = not self.batches_compared
        if not training or not (broadcast or joining or check_due or first):
            return None
        state.deadline.begin(f"a training forward of step {steps}")  # 7
        if first:  # 8
            self.batches_compared = True
            warn_if_same_batch(batch, state.deadline)
        if check_due:  # 9
            self.replicas_checked_at = steps
            state.check_replicas()
        num_active = None
        if joining and state.join.due(sync):  # 10
            num_active = state.join.active_round(sync, broadcast)
        if broadcast:  # 11
            state.broadcast_buffers()
        return num_active
