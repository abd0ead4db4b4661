"""``gradsync.DistributedDataParallel``: the user-facing wrapper.

Construction makes replicas equal (model check, rank 0 broadcast) and plans the buckets; the
:class:`~gradsync.ddp.reducer.Reducer` does the per-step work from autograd hooks. Read
``naive.py`` first: this module does the same thing, overlapped with backward.
"""

from __future__ import annotations

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

from gradsync.comm import AllReduceAlgorithm
from gradsync.comm.formats import Compression, describe_compression
from gradsync.ddp.checks.diagnostics import check_can_wrap
from gradsync.ddp.checks.model import refuse_everywhere
from gradsync.ddp.compat import pickling, torch_args
from gradsync.ddp.compat.torch_args import Device
from gradsync.ddp.compat.torch_surface import TorchSurface
from gradsync.ddp.lifecycle import Lifecycle
from gradsync.ddp.main_grads import check_main_grad_dtype
from gradsync.ddp.options import Setting, SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.replan.autoplan import BucketPlan
from gradsync.ddp.replan.autotune import AutoBuckets
from gradsync.ddp.sharding import ShardedSteps
from gradsync.ddp.state import DDPState
from gradsync.errors import UsageError
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

    @pickling.remember_arguments  # for a pickled wrapper: compat/pickling.py
    def __init__(  # torch DDP's parameters in torch's order, then gradsync's own
        self,
        module: nn.Module,
        device_ids: Sequence[Device] | None = None,
        output_device: Device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: DeviceMesh | None = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = 1.0,
        reduction: str = "mean",
        algorithm: str | AllReduceAlgorithm = "native",
        compression: Compression = None,
        timeout: float | timedelta = 300.0,
        check_finite: bool = False,
        check_replicas_every: int = 0,
        main_grad_dtype: torch.dtype | None = None,
        straggler_every: int = 10,
        deterministic: int | None = None,
    ) -> None:
        arguments = dict(locals())  # by name: torch_args and SyncOptions take theirs from it
        nn.Module.__init__(self)  # not torch DDP's __init__: it would build torch's C++ reducer
        Joinable.__init__(self)
        check_can_wrap(module, DistributedDataParallel)
        torch_args.warn_deprecated(check_reduction, broadcast_buffers, forward_sync_buffers)
        self.module, self.device_mesh, self.dim = module, device_mesh, dim
        process_group = data_parallel_group(process_group, device_mesh)
        self.process_group = process_group  # type: ignore[assignment]  # torch: never None
        self.parameters_to_ignore = torch_args.ignored_names(module)
        self._sync_backward = self.require_forward_param_sync = True  # torch's flags
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params  # torch's hints: the
        self.batched_grad_copy = batched_grad_copy  # results are the same either way
        self._state = self._new_state(arguments, process_group)

    def _new_state(self, arguments: dict[str, Any], group: dist.ProcessGroup | None) -> DDPState:
        """The state behind this wrapper, from its constructor's ``arguments``: a refusal on one
        rank is raised on every rank, in place of the model check (a collective)."""
        module, ignore = self.module, self.parameters_to_ignore
        where = torch_args.module_device(module)
        deadline = new_wrapper_deadline(group, as_timedelta(arguments["timeout"]), where)
        try:
            placed, each_forward, at_init = torch_args.resolve(module, ignore, arguments)
            options = SyncOptions.of(
                arguments,
                broadcast_buffers=each_forward,
                init_sync_buffers=at_init,
                timeout=deadline.timeout,
            )
            named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
            layouts = grad_layouts(named, group)
            grad_dtype, as_view = options.main_grad_dtype, options.gradient_as_bucket_view
            check_main_grad_dtype(grad_dtype, as_view, layouts, module)
        except UsageError as exc:
            refuse_everywhere(exc, deadline)
        # torch DDP's public record of where the replica lives (Accelerate and Lightning read it).
        self.device_ids, self.output_device = placed.device_ids, placed.output_device
        self.device, self.device_type = placed.device, placed.device_type
        self.is_multi_device_module = placed.is_multi_device_module
        inputs_to = self.device if self.device_ids else None  # torch's rule, with device_ids
        axes = axis_names(self.device_mesh)
        return DDPState(module, ignore, options, deadline, layouts, axes, inputs_to)

    def regroup(self, from_rank_0: bool = False, first_batches_compared: bool = False) -> None:
        """Go on over the new default group after a membership change (gradsync.recovery),
        between steps: new buckets, hooks and private group; the replicas are checked equal
        (``ReplicaMismatchError``), or with ``from_rank_0`` take rank 0's, as at construction.
        ``first_batches_compared``: every member knows that all compared their first batches
        (one gather fewer); it must be the same on every rank."""
        state = self._state
        if state.torch_hook:
            raise UsageError("regroup() covers no comm hook (per-rank state)")
        # a mesh: laid out again in place over the new default group (mesh/rebuild.py)
        group = data_parallel_group(None, self.device_mesh) or dist.group.WORLD
        self.process_group = group  # type: ignore[assignment]
        where, name = torch_args.module_device(self.module), "the regrouped DDP"
        deadline = Deadline.for_group(group, self.options.timeout, name, where)
        layouts = grad_layouts(state.named_parameters(), group)
        axes = axis_names(self.device_mesh)
        state.regroup(deadline, layouts, axes, from_rank_0, first_batches_compared)

    # -- the settings, as torch DDP exposes them (read-only: they must agree across ranks) ----
    reduction, broadcast_buffers, compression, timeout = Setting(), Setting(), Setting(), Setting()
    find_unused_parameters, static_graph, gradient_as_bucket_view = Setting(), Setting(), Setting()
    check_replicas_every, main_grad_dtype, deterministic = Setting(), Setting(), Setting()
    forward_sync_buffers, algorithm = Setting("broadcast_buffers"), Setting("all_reduce")

    # -- what the state owns, as torch DDP and gradsync's users read it ----------------------
    @property
    def options(self) -> SyncOptions:
        """Every setting, as agreed across ranks at construction (``ddp/options.py``)."""
        return self._state.options

    @property
    def reducer(self) -> Reducer:
        """The reducer, as torch DDP's ``.reducer`` (``compat/torch_reducer.py``)."""
        return self._state.reducer

    @property
    def timeline(self) -> StepTimeline:
        """Every rank's step phases and the straggler reports (``timing/timeline.py``)."""
        return self._state.timeline

    @property
    def lifecycle(self) -> Lifecycle:
        """Loaded, configurable, training, failed or retired ([Note: the wrapper's lifecycle])."""
        return Lifecycle.LOADED if pickling.LOADED in self.__dict__ else self._state.lifecycle

    @property
    def bucket_specs(self) -> list[BucketSpec]:
        """The layout of the buckets in use (``bucket_cap_mb="auto"`` may replace it)."""
        return self.reducer.specs

    @property
    def bucket_cap_mb(self) -> float | None:
        """The cap (MiB) the buckets in use were planned with (``math.inf``: one bucket)."""
        return self._state.bucket_cap_mb

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
        return self._state.forward.autotune

    @property
    def sharded_steps(self) -> ShardedSteps | None:
        """The wrapper's side of the optimizer :meth:`shard_optimizer` built (``None``: none)."""
        return self._state.sharded

    # -- a forward ---------------------------------------------------------------------------
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
        self._state.timeline.recorder.forward_ended()  # a no-op unless a training forward began

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
        state = self._state
        return state.forward.run(
            state,
            self,
            args,
            kwargs,
            training=state.module.training,  # not self.module: nn.Module's __getattr__
            sync=self._sync_backward,
            broadcast=state.options.broadcast_buffers and bool(state.buffers),
        )

    def count_items(self, num_items: float | torch.Tensor) -> None:
        """Declare how many items (samples, valid tokens) this micro-batch's summed loss covers:
        ``reduction="item_mean"`` divides by the step's total, the exact mean over items."""
        self.reducer.count_items(num_items)

    def check_replicas(self) -> None:
        """Raise ``ReplicaMismatchError`` on every rank unless all replicas are bit-identical.

        Compares parameters, and buffers too when ``broadcast_buffers=False`` (with it, buffers
        are rank 0's at every forward and legitimately differ in between)."""
        self._state.check_replicas()

    def join(  # type: ignore[override]  # torch's arguments, and gradsync's optimizer first
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> AbstractContextManager[Any]:
        """Train on uneven data: ``with model.join(optimizer):`` is gradsync's exact form,
        ``with model.join():`` torch DDP's (see ``JoinProtocol.join`` in ``join.py``)."""
        torchs = divide_by_initial_world_size, enable, throw_on_early_termination
        return self._state.join.join(self._state, self, optimizer, *torchs)

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
        return self._state.shard_optimizer(optimizer_class, defaults)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Run torch's DDP communication hook ``hook(state, bucket) -> Future[Tensor]`` on every
        bucket, as torch DDP's; on every rank, once, before the first forward (torch_hooks.py)."""
        self._state.register_comm_hook(state, hook, describe_compression(self.compression))

    def finish_gradient_synchronization(self) -> None:
        """Wait for outstanding reductions; idempotent. Backward already calls it at its end."""
        self.reducer.finish_gradient_synchronization()

    # -- checkpoints: the module's (state_dict, in torch_surface.py) and gradsync's own -----
    def sync_state_dict(self) -> dict[str, Any]:
        """gradsync's own training state (``state_dict()`` stays the module's): step counter,
        last replica check, bucket plan, compression state. ``ProtocolError`` inside an
        accumulation window (no checkpoint holds the no_sync() gradients), or inside ``join()``
        once a rank ran out of data (it takes no part in a save)."""
        return self._state.sync_state(self._state.join.waiting(self))

    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`sync_state_dict`. A collective (one small all-gather): a state
        one rank cannot load is refused on every rank before any rank has changed anything."""
        compression = describe_compression(self.compression)
        self._state.load_sync_state(state, compression, self._state.join.waiting(self))
