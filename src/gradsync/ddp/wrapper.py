"""``gradsync.DistributedDataParallel``: the user-facing wrapper.

Construction makes replicas equal (model check, rank 0 broadcast) and plans the buckets; the
:class:`~gradsync.ddp.reducer.Reducer` does the per-step work from autograd hooks. Read
``naive.py`` first: this module does the same thing, overlapped with backward.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync.comm import AllReduceAlgorithm, CommHook, torch_hooks
from gradsync.comm.formats import Compression, describe_compression
from gradsync.ddp import sharding
from gradsync.ddp.build import first_reducer
from gradsync.ddp.checks.diagnostics import check_can_wrap, check_replicas
from gradsync.ddp.checks.model import make_replicas_equal, refuse_everywhere
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.compat import pickling, torch_args
from gradsync.ddp.compat.torch_args import Device
from gradsync.ddp.compat.torch_surface import TorchSurface
from gradsync.ddp.forward import ForwardProtocol, Lifecycle, WrapperOps
from gradsync.ddp.join import JoinProtocol, JoinRounds
from gradsync.ddp.main_grads import check_main_grad_dtype
from gradsync.ddp.options import Setting, SyncOptions
from gradsync.ddp.plan import BucketSpec, cap_to_bytes, plan_buckets
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.replan.autoplan import BucketPlan
from gradsync.ddp.replan.autotune import AutoBuckets
from gradsync.errors import ProtocolError, UsageError
from gradsync.failfast.deadline import Deadline, as_timedelta, new_wrapper_deadline
from gradsync.mesh.axes import axis_names, data_parallel_group
from gradsync.mesh.dtensors import grad_layouts
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.timing import StepTimeline


class DistributedDataParallel(TorchSurface, TorchDDP):  # type: ignore[override, misc]
    """Data parallelism whose N-process training equals one-process training on the full batch.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``: it takes torch's arguments in
    torch's order, each with torch's meaning or refused with a ``UsageError`` saying what to use
    instead (``torch_args.py``), and it *is* a torch DDP to ``isinstance`` (so Accelerate,
    Lightning and torch.compile treat it as one) while none of torch's reducer runs: see
    ``torch_surface.py`` for every torch DDP member and what gradsync does for it.

    Args (torch's, in torch's order; what each does here is in ``compat/torch_args.py``):
        module: the model; every rank must hold the same parameter names, shapes, dtypes and
            ``requires_grad`` flags (else ``ModelMismatchError``, a ``ValueError``, everywhere).
        device_ids, output_device, dim, broadcast_buffers, process_group and the rest:
            torch's meaning, or refused with what to use instead (``mixed_precision``,
            ``bucket_cap_mb_list``, the delayed all-reduce pair).
        bucket_cap_mb: bucket size in MiB. ``None`` (the default): torch's 25 on one host,
            ``"scaled"`` across hosts (an eighth of the gradients' bytes, 1 to 25 MiB; [Note:
            the default bucket cap] in ``plan.py``); ``0``: one all-reduce per parameter;
            ``math.inf``: one bucket per dtype; ``"auto"``: from this job's profile.
        device_mesh: instead of ``process_group``, the (sub-)mesh whose ranks saw different
            data, e.g. ``mesh["dp"]`` or ``mesh["dp", "cp"]`` (never a tensor-parallel axis).

    Keyword-only, gradsync's own, each documented on its field of ``SyncOptions``
    (``ddp/options.py``): ``first_bucket_cap_mb``; ``reduction`` (``"mean"``, ``"sum"`` or
    ``"item_mean"``: divided by the items declared with :meth:`count_items`); ``algorithm``
    and ``compression`` (``None``, ``"bf16"``, ``"fp16"``, ``PowerSGD``); ``timeout`` (past
    it every waiting rank raises ``CollectiveTimeoutError``); ``check_finite``;
    ``check_replicas_every``; ``main_grad_dtype`` (into ``p.main_grad``); ``straggler_every``
    (steps per :attr:`timeline` report, ``0``: off); ``deterministic`` (``deterministic.py``)."""

    _torch_hook: Callable[..., Any] | None = None  # set by register_comm_hook
    _sharded: sharding.ShardedSteps | None = None  # set by shard_optimizer

    @pickling.remember_arguments  # for a pickled wrapper: compat/pickling.py
    def __init__(  # torch DDP's parameters in torch's order, then gradsync's own
        self, module: nn.Module, device_ids: Sequence[Device] | None = None,
        output_device: Device | None = None, dim: int = 0, broadcast_buffers: bool | None = None,
        init_sync: bool = True, process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None, find_unused_parameters: bool = False,
        check_reduction: bool = False, gradient_as_bucket_view: bool = False,
        static_graph: bool = False, delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
        device_mesh: DeviceMesh | None = None, skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None, batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None, *, first_bucket_cap_mb: float | None = 1.0,
        reduction: str = "mean", algorithm: str | AllReduceAlgorithm = "native",
        compression: Compression = None, timeout: float | timedelta = 300.0,
        check_finite: bool = False, check_replicas_every: int = 0,
        main_grad_dtype: torch.dtype | None = None, straggler_every: int = 10,
        deterministic: int | None = None,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)  # not torch DDP's __init__: it would build torch's C++ reducer
        Joinable.__init__(self)
        check_can_wrap(module, DistributedDataParallel)
        torch_args.warn_deprecated(check_reduction, broadcast_buffers, forward_sync_buffers)
        self.module, self.device_mesh, self.dim = module, device_mesh, dim
        process_group = data_parallel_group(process_group, device_mesh)
        self.process_group = process_group  # type: ignore[assignment]  # torch: never None
        self._deadline = new_wrapper_deadline(
            process_group, as_timedelta(timeout), torch_args.module_device(module)
        )
        self.parameters_to_ignore = torch_args.ignored_names(module)
        try:  # a refusal on one rank is raised on every rank, in place of the model check
            where, each_forward, at_init = torch_args.resolve(
                module, self.parameters_to_ignore, device_ids, output_device, broadcast_buffers,
                forward_sync_buffers, delay_all_reduce_named_params=delay_all_reduce_named_params,
                param_to_hook_all_reduce=param_to_hook_all_reduce,
                mixed_precision=mixed_precision, bucket_cap_mb_list=bucket_cap_mb_list,
            )  # fmt: skip
            self.options = SyncOptions(
                bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                gradient_as_bucket_view=gradient_as_bucket_view,
                broadcast_buffers=each_forward, init_sync=init_sync, init_sync_buffers=at_init,
                reduction=reduction, algorithm=algorithm, straggler_every=straggler_every,
                compression=compression, timeout=self._deadline.timeout, check_finite=check_finite,
                check_replicas_every=check_replicas_every, main_grad_dtype=main_grad_dtype,
                deterministic=deterministic,
            )  # fmt: skip
            self._layouts = grad_layouts(self._named_parameters(), process_group)
            check_main_grad_dtype(main_grad_dtype, gradient_as_bucket_view, self._layouts, module)
        except UsageError as exc:
            refuse_everywhere(exc, self._deadline)
        # torch DDP's public record of where the replica lives (Accelerate and Lightning read it).
        self.device_ids, self.output_device = where.device_ids, where.output_device
        self.device, self.device_type = where.device, where.device_type
        self.is_multi_device_module = where.is_multi_device_module
        self._sync_backward = self.require_forward_param_sync = True  # torch's flags
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params  # torch's hints: the
        self.batched_grad_copy = batched_grad_copy  # results are the same either way
        self._build(axis_names(device_mesh))

    def _build(self, axes: tuple[str, ...], equal_by: SyncOptions | None = None) -> None:
        """Make the replicas equal as ``equal_by`` (default: the options) says; build the reducer
        and the protocols, which reach the wrapper through what it hands them."""
        self.timeline = StepTimeline.of(self.options.straggler_every, self._deadline)
        named_params, named_buffers = self._named_parameters(), self._named_buffers()
        equal_by = equal_by or self.options
        settings = equal_by.settings(axes)
        make_replicas_equal(named_params, named_buffers, equal_by, settings, self._deadline)
        self._buffers_to_sync = [b for _, b in named_buffers]
        watch = ParameterWatch(self.module, self.parameters_to_ignore)
        self.reducer, self.bucket_sizes, self.bucket_cap_mb = first_reducer(
            watch, self.options, self._deadline, self.timeline, self._layouts, self.module, axes
        )
        me = weakref.proxy(self)  # no cycle: a dropped wrapper is freed at once, not by the gc
        self._join = JoinProtocol(self._deadline, me, JoinRounds(  # type: ignore[arg-type]
            lambda: me.reducer, lambda: me._broadcast_buffers(), lambda: me._take_final_state()
        ))  # fmt: skip
        ops = WrapperOps(
            lambda: me.reducer, lambda: me._broadcast_buffers(), lambda: me.check_replicas(),
            lambda specs, cap: me._adopt_plan(specs, cap), lambda last: me._plan_last(last),
            lambda: (me.bucket_sizes, me.bucket_cap_mb),
        )  # fmt: skip
        inputs_to = self.device if self.device_ids else None  # torch's rule, with device_ids
        self._forward = ForwardProtocol(
            self.options, self._deadline, self._join, self.timeline, ops, inputs_to
        )

    def regroup(self, from_rank_0: bool = False) -> None:
        """Go on over the new default group after a membership change (gradsync.recovery),
        between steps: new buckets, hooks and private group; the replicas are checked equal
        (``ReplicaMismatchError``), or with ``from_rank_0`` take rank 0's, as at construction."""
        if self.device_mesh is not None or self._sharded is not None or self._torch_hook:
            raise UsageError("regroup() covers no mesh, ZeRO-1 or comm hook (per-rank state)")
        self.reducer.retire()
        self.process_group = dist.group.WORLD  # type: ignore[assignment]
        where, opts, name = torch_args.module_device(self.module), self.options, "the regrouped DDP"
        self._deadline = Deadline.for_group(self.process_group, opts.timeout, name, where)
        self._layouts = grad_layouts(self._named_parameters(), self.process_group)
        checked = dataclasses.replace(opts, init_sync=False, init_sync_buffers=False)
        self._build((), opts if from_rank_0 else checked)

    # -- the settings, as torch DDP exposes them (read-only: they must agree across ranks) ----
    reduction, broadcast_buffers, compression, timeout = Setting(), Setting(), Setting(), Setting()
    find_unused_parameters, static_graph, gradient_as_bucket_view = Setting(), Setting(), Setting()
    check_replicas_every, main_grad_dtype, deterministic = Setting(), Setting(), Setting()
    forward_sync_buffers, algorithm = Setting("broadcast_buffers"), Setting("all_reduce")

    @property
    def bucket_specs(self) -> list[BucketSpec]:
        """The layout of the buckets in use (``bucket_cap_mb="auto"`` may replace it)."""
        return self.reducer.specs

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters that are data-parallel (all but torch DDP's ignore list)."""
        ignore = self.parameters_to_ignore
        return [(n, p) for n, p in self.module.named_parameters() if n not in ignore]

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        ignore = self.parameters_to_ignore
        return [(n, b) for n, b in self.module.named_buffers() if n not in ignore]

    # -- the reducer: built here, replaced only here -------------------------------------------
    def _replace_reducer(
        self, specs: list[BucketSpec], *, comm_hook: CommHook | None = None,
    ) -> Reducer:  # fmt: skip
        """Install a reducer with buckets ``specs`` (and ``comm_hook``) that continues the
        current one (``Reducer.succeed``): the only way the reducer changes, between steps."""
        self.reducer = Reducer.succeed(self.reducer, specs, comm_hook=comm_hook)
        return self.reducer

    def _adopt_plan(self, specs: list[BucketSpec], cap_mb: float | None) -> Reducer:
        """``bucket_cap_mb="auto"``: buckets ``specs``, planned with ``cap_mb``, from now on."""
        # the cap the buckets in use were planned with (the plan's None: one bucket)
        self.bucket_cap_mb = math.inf if cap_mb is None else cap_mb
        return self._replace_reducer(specs)

    def _plan_last(self, last: tuple[int, ...]) -> None:
        """Buckets with the parameters ``last`` planned last (see unused_last.py); not once
        the parameter set changed (the next reduction raises ParametersChangedError)."""
        if self.reducer.watch.changes():
            return
        cap, first = self.bucket_cap_mb, self.options.first_bucket_cap_mb
        specs = plan_buckets(self.bucket_sizes, cap_to_bytes(cap), cap_to_bytes(first), last)
        if specs != self.reducer.specs:
            self._replace_reducer(specs)

    @torch.compiler.disable(recursive=False)  # see _prepare_forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if pickling.LOADED in self.__dict__ and not torch.is_grad_enabled():  # not built yet
            return self.module(*args, **kwargs)  # and nothing to synchronise: its module's
        args, kwargs = self._prepare_forward(args, kwargs)
        out = self._run_module(args, kwargs)
        self._forward_returned()
        return out

    @torch.compiler.disable  # a clock reading: never traced
    def _forward_returned(self) -> None:
        self.timeline.recorder.forward_ended()  # a no-op unless a training forward began

    @torch.compiler.disable(recursive=False)  # see _prepare_forward
    def _run_module(self, args: Any, kwargs: Any) -> Any:
        # As torch DDP does: marks this wrapper active while the module runs, so that
        # torch.compile's DDPOptimizer splits a compiled module's graph at bucket boundaries.
        with self._inside_ddp_forward():
            return self.module(*args, **kwargs)

    @torch.compiler.disable  # never traced, nor anything it calls
    def _prepare_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """What a forward does before its module runs, the same on every rank: [Note: the
        forward protocol] in ``forward.py``; returns the inputs to run the module with.
        torch.compile runs it eagerly and skips the frames of forward and _run_module
        (recursive=False: what they call is traced): it traces the module call alone, as one
        graph split by DDPOptimizer, and breaks only in torch's _inside_ddp_forward, as torch
        DDP does."""
        broadcast = self.broadcast_buffers and bool(self._buffers_to_sync)
        sync = bool(self.require_backward_grad_sync)
        training = self.module.training
        return self._forward.run(args, kwargs, self, training, sync, broadcast)

    @property
    def lifecycle(self) -> Lifecycle:
        """Loaded, configurable, training, failed or retired ([Note: the wrapper's lifecycle])."""
        return Lifecycle.LOADED if pickling.LOADED in self.__dict__ else self._forward.lifecycle

    def _broadcast_buffers(self, src: int = 0) -> None:
        what = f"the broadcast of rank {src}'s buffers before a training forward"
        self._deadline.broadcast(self._buffers_to_sync, src, what)

    def count_items(self, num_items: float | torch.Tensor) -> None:
        """Declare how many items (samples, valid tokens) this micro-batch's summed loss covers:
        ``reduction="item_mean"`` divides by the step's total, the exact mean over items."""
        self.reducer.count_items(num_items)

    def check_replicas(self) -> None:
        """Raise ``ReplicaMismatchError`` on every rank unless all replicas are bit-identical.

        Compares parameters, and buffers too when ``broadcast_buffers=False`` (with it, buffers
        are rank 0's at every forward and legitimately differ in between)."""
        self._parameters_ready()
        named: list[tuple[str, torch.Tensor]] = list(self._named_parameters())
        if not self.broadcast_buffers:
            named += self._named_buffers()
        check_replicas(named, self._deadline)

    def join(  # type: ignore[override]  # torch's arguments, and gradsync's optimizer first
        self, optimizer: torch.optim.Optimizer | None = None, *,
        divide_by_initial_world_size: bool = True, enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> AbstractContextManager[Any]:  # fmt: skip
        """Train on uneven data: ``with model.join(optimizer):`` is gradsync's exact form,
        ``with model.join():`` torch DDP's (see ``JoinProtocol.join`` in ``join.py``)."""
        torchs = divide_by_initial_world_size, enable, throw_on_early_termination
        return self._join.join(optimizer, *torchs)

    def _take_final_state(self) -> None:
        """The end of a join: every rank takes the state of a rank that was active last."""
        self._parameters_ready()
        src = self._join.authoritative_rank()
        what = f"the final broadcast of rank {src}'s state at the end of join()"
        params = [p.data for _, p in self._named_parameters()]
        self._deadline.broadcast(params + self._buffers_to_sync, src, what)

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch's flag: ``False`` makes the backward of a forward run now accumulate locally.
        Set while the module runs, before its backward begins, it decides that backward too
        (Lightning's manual optimization runs backward inside the forward; see Reducer.decide)."""
        return self._sync_backward

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, sync: bool) -> None:
        self._sync_backward = bool(sync)
        if TorchDDP._active_ddp_module is self:  # inside _run_module
            self.reducer.decide(self._sync_backward)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for forwards run inside this context. As in torch DDP
        the forward decides: the backward of a forward run inside ``no_sync`` does not
        communicate; the next synchronised backward reduces everything accumulated, once per
        bucket. It sets :attr:`require_backward_grad_sync`, as a loop may (nanoGPT does)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def shard_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
    ) -> ShardedOptimizer:
        """ZeRO-1: an ``optimizer_class(**defaults)`` whose state is sharded over the ranks, as
        torch's DDP with ``ZeroRedundancyOptimizer``: ``.grad`` is reduced as always, and
        ``opt.step()`` steps this rank's slices and all-gathers them ([Note: sharded steps in
        the wrapper] in ``sharding.py``). On every rank, once, before the first forward."""
        sharding.refuse_unsupported(self.options, self._layouts, self._torch_hook is not None)
        if self.lifecycle is not Lifecycle.CONFIGURABLE or self._sharded is not None:
            raise ProtocolError("shard_optimizer() must be called once, before the first forward")
        reducer, me = self.reducer, weakref.proxy(self)  # the reducer in place at each step:
        steps = sharding.shard(
            reducer.specs, list(zip(reducer.names, reducer.params, strict=True)),
            reducer.watch.changes(), self._deadline, optimizer_class, defaults,
            lambda: me.reducer.num_reductions,  # one step per synchronised backward
        )  # fmt: skip
        reducer.watch.count_with(steps.updates)  # each rank steps a different number of slices
        self._sharded = steps
        return steps.optimizer

    def _parameters_ready(self) -> None:
        """Wait for the all-gathers a sharded optimizer's step that raised left in flight."""
        if self._sharded is not None:
            self._sharded.wait_all()

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Run torch's DDP communication hook ``hook(state, bucket) -> Future[Tensor]`` on every
        bucket, as torch DDP's; on every rank, once, before the first forward (torch_hooks.py)."""
        facts = torch_hooks.WrapperFacts(
            describe_compression(self.compression), self.algorithm.name,
            registered=self._torch_hook is not None,
            forward_ran=self.lifecycle is not Lifecycle.CONFIGURABLE,
            sharded=self._sharded is not None, auto=self.bucket_tuner is not None,
            deterministic=self.options.deterministic is not None,
        )  # fmt: skip
        numels = [b.spec.numel for b in self.reducer.buckets]
        adapter = torch_hooks.register(state, hook, self._deadline, numels, facts)
        self._replace_reducer(self.reducer.specs, comm_hook=adapter)
        self._torch_hook = hook
        self._forward.unused_last.disable()  # the hook's state may be per bucket

    def finish_gradient_synchronization(self) -> None:
        """Wait for outstanding reductions; idempotent. Backward already calls it at its end."""
        self.reducer.finish_gradient_synchronization()

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_specs)

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """With ``bucket_cap_mb="auto"``, the plan chosen (``None`` before the switch)."""
        return self.bucket_tuner.plan if self.bucket_tuner is not None else None

    @property
    def bucket_tuner(self) -> AutoBuckets | None:
        """With ``bucket_cap_mb="auto"``, what chooses the plan (``settled`` once it is final)."""
        return self._forward.autotune

    # -- checkpoints: the module's (state_dict, in torch_surface.py) and gradsync's own -----
    def sync_state_dict(self) -> dict[str, Any]:
        """gradsync's own training state (``state_dict()`` stays the module's): step counter,
        last replica check, bucket plan, compression state. ``ProtocolError`` inside an
        accumulation window or ``join()``: no checkpoint holds the no_sync() gradients."""
        return self._forward.sync_state()

    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`sync_state_dict`. A collective (one small all-gather): a state
        one rank cannot load is refused on every rank before any rank has changed anything."""
        self._forward.load_sync_state(state, describe_compression(self.compression))
