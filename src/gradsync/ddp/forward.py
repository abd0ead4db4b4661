"""What a forward through the wrapper does before its module runs, and the wrapper's lifecycle.

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
  8 *  the join handshake: how many ranks have data         training, inside join (with
                                                            deterministic=: synchronised,
                                                            after 10)
  9 *  compare the first batches (a fingerprint)            the first training forward
 10 *  compare the replicas' checksums                      every check_replicas_every steps
 11 *  broadcast rank 0's buffers                           training, broadcast_buffers, and
                                                            the module has buffers
 12    open or continue the step window; decide sync        always
 13    mark the forward's start on the step timeline        training

Steps 5 and 6 may replace the reducer (``Reducer.succeed``); steps 8-12 use the one in place
after them. A :class:`~gradsync.errors.GradsyncError` raised on the way is left in this rank's
arrival record, so that a peer's timeout names it.

[Note: the wrapper's lifecycle]
A wrapper is CONFIGURABLE from construction until its first forward with grad enabled:
``shard_optimizer()`` and ``register_comm_hook()`` change how every step runs and must come
before it. Then it is TRAINING. It is FAILED once one of its collectives failed or timed out
(its process group may still hold that collective, so it issues no more) and RETIRED once a
newer wrapper of the same parameters took their hooks over. :attr:`ForwardProtocol.lifecycle`
is the one place that says which; FAILED and RETIRED are facts of the deadline and the reducer,
read from them rather than copied. An unpickled wrapper is LOADED (its module, not built)
until its first use that involves the ranks builds it ([Note: a pickled wrapper]).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable

from gradsync.ddp.checks.diagnostics import warn_if_same_batch
from gradsync.ddp.compat import torch_args
from gradsync.ddp.compat.state_keys import refuse_mid_step, refuse_unloadable
from gradsync.ddp.join import JoinProtocol
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.replan.autotune import AutoBuckets
from gradsync.ddp.replan.unused_last import UnusedLast
from gradsync.errors import GradsyncError, ProtocolError
from gradsync.failfast.deadline import Deadline
from gradsync.timing import StepTimeline


class Lifecycle(enum.Enum):
    """Where a wrapper is in its life ([Note: the wrapper's lifecycle])."""

    LOADED = "loaded"  # unpickled, built at its first use (compat/pickling.py)
    CONFIGURABLE = "configurable"  # built, no forward yet: shard_optimizer, register_comm_hook
    TRAINING = "training"  # a forward with grad enabled ran through it
    FAILED = "failed"  # a collective failed or timed out: it issues no more
    RETIRED = "retired"  # a newer wrapper of the same parameters took them over


@dataclass(frozen=True)
class WrapperOps:
    """What the protocol asks of the wrapper, the only writer of the wrapper's state."""

    reducer: Callable[[], Reducer]  # the reducer in place now
    broadcast_buffers: Callable[[], None]  # rank 0's buffers to every rank
    check_replicas: Callable[[], None]
    adopt_plan: Callable[[list[BucketSpec], float | None], Reducer]  # "auto" switched
    plan_last: Callable[[tuple[int, ...]], None]  # buckets with these parameters last
    bucket_plan_inputs: Callable[[], tuple[list[tuple[int, torch.dtype]], float | None]]


class ForwardProtocol:
    """The steps of [Note: the forward protocol], and the state they keep between forwards:
    the lifecycle, whether the first batches were compared, the last replica check, and the
    two re-planners that act at step boundaries."""

    def __init__(
        self,
        options: SyncOptions,
        deadline: Deadline,
        join: JoinProtocol,
        timeline: StepTimeline,
        ops: WrapperOps,
        inputs_to: torch.device | None,
    ) -> None:
        self.deadline, self.join, self.timeline, self.ops = deadline, join, timeline, ops
        self.inputs_to = inputs_to  # step 1: the replica's device, with device_ids
        self.check_every = options.check_replicas_every
        self.leaves = options.deterministic is not None  # see [Note: leaves and join]
        self.autotune = AutoBuckets(options.first_bucket_cap_mb) if options.auto else None
        self.unused_last = UnusedLast(options)
        self.replicas_checked_at = 0  # the step of the last check_replicas_every check
        self._trained = False  # a forward with grad enabled ran: no longer configurable
        self._first_batch_checked = False

    def sync_state(self) -> dict[str, Any]:
        """What ``sync_state_dict()`` saves: the step count, the last replica check, the unused
        parameters planned last and the comm hook's state; refused mid-step."""
        reducer = self.ops.reducer()
        refuse_mid_step(reducer.window_open, self.join.joining)
        state: dict[str, Any] = {
            "num_reductions": reducer.num_reductions,
            "replicas_checked_at": self.replicas_checked_at,
        }
        if (last := self.unused_last.state()) is not None:
            state["unused_last"] = last  # the buckets' plan (see unused_last.py)
        comm = reducer.comm_hook.state_dict()
        return {**state, "comm": comm} if comm else state

    def load_sync_state(self, state: Mapping[str, Any], compression: str) -> None:
        """Continue from :meth:`sync_state` (a collective: a state one rank cannot load is
        refused on every rank before any rank has changed anything)."""
        reducer = self.ops.reducer()
        refuse_mid_step(reducer.window_open, self.join.joining)
        refuse_unloadable(reducer.comm_hook, compression, state, self.deadline)
        self.unused_last.load(state.get("unused_last"), self.ops.plan_last)
        reducer = self.ops.reducer()  # planning the unused parameters last may replace it
        reducer.resume_from(int(state["num_reductions"]))
        self.replicas_checked_at = int(state["replicas_checked_at"])
        if "comm" in state:
            reducer.comm_hook.load_state_dict(state["comm"])

    @property
    def lifecycle(self) -> Lifecycle:
        if self.deadline.failure is not None:
            return Lifecycle.FAILED
        if self.ops.reducer().retired:
            return Lifecycle.RETIRED
        return Lifecycle.TRAINING if self._trained else Lifecycle.CONFIGURABLE

    def refuse_unless_usable(self) -> None:
        """Step 4: raise if a forward now would break the protocol, before any collective."""
        state = self.lifecycle
        if state is Lifecycle.FAILED:
            self.deadline.check_usable()  # raises, saying what failed
        if state is Lifecycle.RETIRED:
            by = self.ops.reducer().retired_by
            raise ProtocolError(
                "this DistributedDataParallel no longer synchronises anything: its module's "
                f"parameters were wrapped again{f' ({by})' if by else ''}, and the newer "
                "wrapper took them over. A module is wrapped once: use the newer wrapper, or "
                "remove the second wrap"
            )
        if self.ops.reducer().reducing:
            raise ProtocolError("forward called while a synchronised backward is still running")

    def run(
        self, args: Any, kwargs: Any, joinable: Joinable, training: bool, sync: bool,
        broadcast: bool,
    ) -> tuple[Any, Any]:  # fmt: skip
        """Steps 1-13 for one forward; returns the inputs to run the module with. ``sync``:
        ``require_backward_grad_sync``; ``broadcast``: buffers are broadcast (step 11)."""
        if self.inputs_to is not None:  # 1: torch's rule, inputs go to the replica's device
            args, kwargs = torch_args.to_device((args, kwargs), self.inputs_to)
        if not torch.is_grad_enabled():  # 2: nothing to synchronise
            return args, kwargs
        self._trained = True
        if training:  # 3: torch's Join counts the ranks still active (join_hook())
            Join.notify_join_context(joinable)
        try:
            self.refuse_unless_usable()  # 4
            if training:
                self._replan()  # 5, 6
            num_active = self._collectives(training, sync, broadcast, (args, kwargs))  # 7-11
            reducer = self.ops.reducer()
            reducer.begin_forward(sync, training, num_active, self.join.divides_by_world)  # 12
            if training:
                self.timeline.recorder.forward_began()  # 13
        except GradsyncError as exc:
            self.deadline.record_error(exc)  # so that the peers' timeout can name it
            raise
        return args, kwargs

    def _replan(self) -> None:
        """Steps 5 and 6: at a step boundary, the buckets may be planned anew."""
        joining = self.join.joining
        if self.autotune is not None:  # decides by itself whether this is a step boundary
            sizes, cap_mb = self.ops.bucket_plan_inputs()
            self.autotune.before_forward(
                self.ops.reducer(), joining, sizes, cap_mb, self.ops.adopt_plan
            )
        reducer = self.ops.reducer()
        if not (reducer.window_open or joining):  # between steps
            self.unused_last.before_forward(reducer.first_unused, self.ops.plan_last)

    def _collectives(
        self, training: bool, sync: bool, broadcast: bool, batch: Any
    ) -> int | None:  # fmt: skip
        """Steps 7-11; returns how many ranks still have data inside join (``None``: all)."""
        steps = self.ops.reducer().num_reductions
        every, joining = self.check_every, self.join.joining
        check_due = every and steps and steps % every == 0 and self.replicas_checked_at != steps
        first = not self._first_batch_checked
        if not training or not (broadcast or joining or check_due or first):
            return None
        self.deadline.begin(f"a training forward of step {steps}")  # 7
        num_active, leaves = None, self.leaves
        if joining and not leaves:  # 8
            num_active = self.join.active_round(sync, broadcast)
        if first:  # 9
            self._first_batch_checked = True
            warn_if_same_batch(batch, self.deadline)
        if check_due:  # 10
            self.replicas_checked_at = steps
            self.ops.check_replicas()
        if joining and leaves and sync:  # 8, deterministic mode: see [Note: leaves and join]
            num_active = self.join.active_round(sync, broadcast)
        if broadcast:  # 11
            self.ops.broadcast_buffers()
        return num_active
