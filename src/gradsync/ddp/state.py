"""A wrapper's state: what its steps run on, owned in one place, for the wrapper's whole life.

:class:`~gradsync.DistributedDataParallel` is the ``nn.Module`` face and torch's surface; the
work is done by one :class:`DDPState` behind it (as torch's FSDP2 splits ``FSDPModule`` from
``FSDPState``). The state owns the settings, the deadline its collectives run under, the mode
([Note: the mode seam] in ``mode.py``), the one reducer (laid out again in place when the plan
or the group changes, never replaced), the step timeline, the forward and join protocols and
the lifecycle ([Note: the wrapper's lifecycle] in ``lifecycle.py``). The protocols are handed
the state on each call and call it directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradsync.comm import torch_hooks
from gradsync.ddp import sharding
from gradsync.ddp.build import plan_reducer
from gradsync.ddp.checks.diagnostics import check_replicas
from gradsync.ddp.checks.model import make_replicas_equal
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.compat.state_keys import refuse_mid_step, refuse_unloadable
from gradsync.ddp.forward import ForwardProtocol
from gradsync.ddp.join import JoinProtocol
from gradsync.ddp.leaves import mode_of
from gradsync.ddp.lifecycle import Lifecycle
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.owners import deadline_peers
from gradsync.ddp.plan import BucketSpec, cap_to_bytes, plan_buckets
from gradsync.ddp.reducer import ReducerPlan
from gradsync.errors import ProtocolError
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.timing import StepTimeline


class DDPState:
    """Everything a wrapper's steps need, and the only writer of it.

    ``module``'s parameters and buffers not named in ``ignore`` are data-parallel over
    ``deadline``'s group; ``layouts``: their DTensor layouts; ``mesh_axes``: the device mesh's
    axes reduced over; ``inputs_to``: the replica's device, where a forward moves its inputs.
    Building it makes the replicas equal (a collective) and plans the buckets."""

    def __init__(
        self,
        module: nn.Module,
        ignore: set[str],
        options: SyncOptions,
        deadline: Deadline,
        layouts: Sequence[GradLayout | None],
        mesh_axes: tuple[str, ...],
        inputs_to: torch.device | None,
    ) -> None:
        self.module, self.ignore, self.options = module, ignore, options
        self.mode = mode_of(options)
        self.sharded: sharding.ShardedSteps | None = None  # shard_optimizer()
        self.torch_hook: Callable[..., Any] | None = None  # register_comm_hook()
        self.deadline, self.layouts = deadline, list(layouts)
        self.timeline = StepTimeline.of(options.straggler_every, deadline)
        plan, watch = self._plan(options, mesh_axes)
        reducer_class = self.mode.reducer_class
        self.reducer = reducer_class(watch, plan, options, deadline, self.timeline, layouts)
        self.join = JoinProtocol(deadline, self.mode.handshake_each_forward)
        self.forward = ForwardProtocol(options, inputs_to)

    def _plan(
        self, equal_by: SyncOptions, mesh_axes: tuple[str, ...], known_same: bool = False
    ) -> tuple[ReducerPlan, ParameterWatch]:
        """Make the replicas equal as ``equal_by`` says (a collective), then plan the buckets."""
        named_params, named_buffers = self.named_parameters(), self.named_buffers()
        settings = equal_by.settings(mesh_axes)
        make_replicas_equal(
            named_params, named_buffers, equal_by, settings, self.deadline, known_same=known_same
        )
        self.buffers = [b for _, b in named_buffers]
        watch = ParameterWatch(self.module, self.ignore)
        args = watch, self.options, self.deadline, self.mode, self.layouts, self.module, mesh_axes
        plan = plan_reducer(*args)
        self.bucket_sizes, self.bucket_cap_mb = plan.sizes, plan.cap_mb
        return plan, watch

    def regroup(
        self,
        deadline: Deadline,
        layouts: Sequence[GradLayout | None],
        mesh_axes: tuple[str, ...],
        from_rank_0: bool,
        batches_compared: bool,
    ) -> None:
        """Go on over ``deadline``'s group, between steps (``gradsync.recovery``): the replicas
        are checked equal, or take rank 0's with ``from_rank_0``; the reducer is laid out
        again for the new group; the protocols start afresh, the first-batch check with them
        unless ``batches_compared`` (agreed by every rank)."""
        self.deadline, self.layouts = deadline, list(layouts)
        self.timeline = StepTimeline.of(self.options.straggler_every, deadline)
        if from_rank_0:  # newcomers: the model check, then rank 0's state, as at construction
            plan, watch = self._plan(self.options, mesh_axes)
        else:  # survivors, checked together at construction (a changed parameter set would
            # have been refused at a step since): only that the replicas are equal
            checked = dataclasses.replace(self.options, init_sync=False, init_sync_buffers=False)
            plan, watch = self._plan(checked, mesh_axes, known_same=True)
        self.reducer.regroup(watch, plan, deadline, self.timeline, layouts)
        if self.sharded is not None:  # its slices already cut for the new group
            names = dict(zip(map(id, self.reducer.params), self.reducer.names, strict=True))
            self.sharded.regroup(deadline, deadline_peers(deadline, names))
            watch.count_with(self.sharded.updates)
        self.join = JoinProtocol(deadline, self.mode.handshake_each_forward)
        self.forward = ForwardProtocol(self.options, self.forward.inputs_to, batches_compared)

    @property
    def lifecycle(self) -> Lifecycle:
        if self.deadline.failure is not None:
            return Lifecycle.FAILED
        if self.reducer.retired:
            return Lifecycle.RETIRED
        return Lifecycle.TRAINING if self.forward.trained else Lifecycle.CONFIGURABLE

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters that are data-parallel (all but torch DDP's ignore list)."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.ignore]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, b) for n, b in self.module.named_buffers() if n not in self.ignore]

    # -- what the protocols ask of it ------------------------------------------------------
    def broadcast_buffers(self, src: int = 0) -> None:
        what = f"the broadcast of rank {src}'s buffers before a training forward"
        self.deadline.broadcast(self.buffers, src, what)

    def check_replicas(self) -> None:
        """``ReplicaMismatchError`` on every rank unless all replicas are bit-identical:
        parameters, and buffers too when they are not broadcast before every forward."""
        self.parameters_ready()
        named: list[tuple[str, torch.Tensor]] = list(self.named_parameters())
        if not self.options.broadcast_buffers:
            named += self.named_buffers()
        check_replicas(named, self.deadline)

    def take_final_state(self) -> None:
        """The end of a join: every rank takes the state of a rank that was active last."""
        self.parameters_ready()
        src = self.join.authoritative_rank()
        what = f"the final broadcast of rank {src}'s state at the end of join()"
        params = [p.data for _, p in self.named_parameters()]
        self.deadline.broadcast(params + self.buffers, src, what)

    def parameters_ready(self) -> None:
        """Wait for the all-gathers a sharded optimizer's step that raised left in flight."""
        if self.sharded is not None:
            self.sharded.wait_all()

    def adopt_plan(self, specs: list[BucketSpec], cap_mb: float | None) -> None:
        """``bucket_cap_mb="auto"``: buckets ``specs``, planned with ``cap_mb``, from now on."""
        # the cap the buckets in use were planned with (the plan's None: one bucket)
        self.bucket_cap_mb = math.inf if cap_mb is None else cap_mb
        self.reducer.replan(specs)

    def plan_last(self, last: tuple[int, ...]) -> None:
        """Buckets with the parameters ``last`` planned last (see unused_last.py); not once
        the parameter set changed (the next reduction raises ParametersChangedError)."""
        if self.reducer.watch.changes():
            return
        cap, first = self.bucket_cap_mb, self.options.first_bucket_cap_mb
        specs = plan_buckets(self.bucket_sizes, cap_to_bytes(cap), cap_to_bytes(first), last)
        if specs != self.reducer.specs:
            self.reducer.replan(specs)

    # -- configuration, before the first forward ----------------------------------------------
    def shard_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
    ) -> ShardedOptimizer:
        """ZeRO-1 over the reducer's buckets ([Note: sharded steps in the wrapper])."""
        sharding.refuse_unsupported(self.options, self.layouts, self.torch_hook is not None)
        if self.lifecycle is not Lifecycle.CONFIGURABLE or self.sharded is not None:
            raise ProtocolError("shard_optimizer() must be called once, before the first forward")
        reducer = self.reducer  # one for the wrapper's life: its step count is the steps'
        self.mode.check_sharding(optimizer_class, defaults, reducer.params, self.deadline)
        named = list(zip(reducer.names, reducer.params, strict=True))
        changes, deadline = reducer.watch.changes(), self.deadline
        steps = sharding.shard(
            reducer.specs, named, changes, deadline, optimizer_class, defaults, reducer
        )
        reducer.watch.count_with(steps.updates)  # each rank steps a different number of slices
        join = self.join
        steps.waiting = lambda: join.ran_out if join.stepping else 0
        self.sharded = steps
        return steps.optimizer

    def register_comm_hook(self, state: object, hook: Callable[..., Any], compression: str):
        """torch's ``hook(state, bucket)`` on every bucket (``comm/torch_hooks.py``)."""
        facts = torch_hooks.WrapperFacts(
            compression,
            self.options.all_reduce.name,
            registered=self.torch_hook is not None,
            forward_ran=self.lifecycle is not Lifecycle.CONFIGURABLE,
            sharded=self.sharded is not None,
            auto=self.forward.autotune is not None,
            deterministic=self.options.deterministic is not None,
        )
        numels = [b.spec.numel for b in self.reducer.buckets]
        adapter = torch_hooks.register(state, hook, self.deadline, numels, facts)
        self.reducer.replan(self.reducer.specs, comm_hook=adapter)
        self.torch_hook = hook
        self.forward.unused_last.disable()  # the hook's state may be per bucket

    # -- checkpoints: gradsync's own training state --------------------------------------------
    def sync_state(self, waiting: int) -> dict[str, Any]:
        """What ``sync_state_dict()`` saves: the step count, the last replica check, the unused
        parameters planned last and the comm hook's state; refused mid-step."""
        reducer = self.reducer
        refuse_mid_step(reducer.window_open, waiting)
        state: dict[str, Any] = {
            "num_reductions": reducer.num_reductions,
            "replicas_checked_at": self.forward.replicas_checked_at,
        }
        if (last := self.forward.unused_last.state()) is not None:
            state["unused_last"] = last  # the buckets' plan (see unused_last.py)
        comm = reducer.comm_hook.state_dict()
        return {**state, "comm": comm} if comm else state

    def load_sync_state(self, state: Mapping[str, Any], compression: str, waiting: int) -> None:
        """Continue from :meth:`sync_state` (a collective: a state one rank cannot load is
        refused on every rank before any rank has changed anything)."""
        reducer = self.reducer
        refuse_mid_step(reducer.window_open, waiting)
        refuse_unloadable(reducer.comm_hook, compression, state, self.deadline)
        self.forward.unused_last.load(state.get("unused_last"), self.plan_last)
        reducer.resume_from(int(state["num_reductions"]))
        self.forward.replicas_checked_at = int(state["replicas_checked_at"])
        if "comm" in state:
            reducer.comm_hook.load_state_dict(state["comm"])
