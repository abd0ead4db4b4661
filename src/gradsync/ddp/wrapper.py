"""``gradsync.DistributedDataParallel``: the user-facing wrapper.

Construction makes replicas equal (model check, rank 0 broadcast) and plans the buckets; the
:class:`~gradsync.ddp.reducer.Reducer` does the per-step work from autograd hooks. Read
``naive.py`` first: this module does the same thing, overlapped with backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradsync.comm import AllReduceAlgorithm, CommHook, torch_hooks
from gradsync.comm.formats import Compression, describe_compression, make_comm_hook, wire_bytes
from gradsync.ddp import sharding
from gradsync.ddp.autoplan import BucketPlan
from gradsync.ddp.autotune import AutoBuckets
from gradsync.ddp.checks.diagnostics import check_can_wrap, check_replicas, warn_if_same_batch
from gradsync.ddp.checks.model import check_same_model, describe, refuse_everywhere
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.join import JoinProtocol
from gradsync.ddp.main_grads import check_main_grad_dtype
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import SCALED, BucketSpec, cap_to_bytes, plan_buckets, resolve_cap
from gradsync.ddp.reducer import GradientShards, Reducer
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.state_keys import comm_state_problem, refuse_mid_step, strip_prefixes
from gradsync.errors import GradsyncError, ProtocolError, UsageError
from gradsync.failfast.deadline import as_timedelta, new_wrapper_deadline
from gradsync.mesh.axes import axis_names, data_parallel_group
from gradsync.mesh.dtensors import grad_layouts, local
from gradsync.optim.sharded import ShardedOptimizer


class DistributedDataParallel(nn.Module):
    """Data parallelism whose N-process training equals one-process training on the full batch.

    Args:
        module: the model; every rank must hold the same parameter names, shapes, dtypes and
            ``requires_grad`` flags (checked here; a mismatch raises ``ModelMismatchError``, a
            ``ValueError``, on every rank).
        process_group: the ranks that hold replicas (default: the world).
        device_mesh: instead of ``process_group``, the (sub-)mesh whose ranks saw different
            data, e.g. ``mesh["dp"]`` or ``mesh["dp", "cp"]`` (its axes are reduced over as one
            group; never include a tensor-parallel axis). Parameters may be DTensors (e.g.
            from ``parallelize_module``): their local shards are reduced and their gradients
            stay DTensors with the parameter's placements. See ``gradsync/mesh/``.
        bucket_cap_mb: bucket size in MiB. ``"scaled"`` (the default): an eighth of the
            gradients' bytes, between 1 and 25 MiB (torch DDP's default from 200 MiB of
            gradients on; see [Note: the default bucket cap] in ``plan.py``); ``0``: one
            all-reduce per parameter; ``None``: one bucket (per dtype); ``"auto"``: chosen
            from this job's profile after a few steps (:attr:`bucket_plan`; see [Note:
            switching the bucket plan] in ``autotune.py``). :attr:`bucket_cap_mb` holds the
            cap in MiB the buckets were planned with.
        first_bucket_cap_mb: a lower cap for the first bucket (the last layers' gradients), so
            communication starts early in backward; ``None`` uses ``bucket_cap_mb`` for all.
        find_unused_parameters: count a parameter without a gradient on some rank as zero there.
            When ``False`` such a parameter raises :class:`UnusedParametersError` on every rank at
            the end of the backward pass that missed it.
        gradient_as_bucket_view: make ``.grad`` tensors views into the bucket buffers (saves one
            copy and the memory of one set of gradients).
        broadcast_buffers: before each training-mode forward with grad enabled, copy rank 0's
            buffers (e.g. BatchNorm running statistics) to every rank.
        reduction: ``"mean"`` averages gradients over ranks (for mean-reduced losses);
            ``"sum"`` sums them (for sum-reduced losses); ``"item_mean"`` divides the sum by the
            number of items (samples, tokens) declared with :meth:`count_items` on all ranks
            and micro-batches of the optimizer step: the exact global mean, whatever the split
            (use with sum-reduced losses).
        algorithm: the all-reduce used for every bucket: a name from ``gradsync.comm.ALGORITHMS``
            or an :class:`~gradsync.comm.AllReduceAlgorithm` instance.
        compression: the wire format of the gradients: ``None`` (exact), ``"bf16"`` or
            ``"fp16"`` (half the bytes, fp32 accumulation) or a
            :class:`gradsync.comm.PowerSGD` (low rank, error feedback); see
            ``gradsync/comm/formats.py`` for what each changes. Used flags and step tags
            always travel exactly.
        timeout: deadline (seconds or ``timedelta``) for each of gradsync's collectives; past it
            every waiting rank raises ``CollectiveTimeoutError`` saying what it waited for.
        check_finite: check each bucket for NaN/Inf before communication; on a hit every rank
            raises ``NonFiniteGradientError`` naming rank, bucket and parameter (costs one
            device-to-host sync per bucket).
        check_replicas_every: every this many optimizer steps, compare parameter checksums
            across ranks (:meth:`check_replicas`) at the next forward; 0 disables.
        main_grad_dtype: e.g. ``torch.float32`` for a bf16 model: gradients are accumulated
            (micro-batches too) and reduced in this dtype, and land in ``p.main_grad``
            (``.grad`` gets them rounded); see [Note: main gradients] in ``main_grads.py``.
    """

    _torch_hook: Callable[..., Any] | None = None  # set by register_comm_hook
    _forward_ran = False  # a forward ran through the wrapper (hooks register before that)
    _first_batch_checked = False  # the first training forward's batches were compared

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        bucket_cap_mb: float | str | None = SCALED,
        first_bucket_cap_mb: float | None = 1.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        reduction: str = "mean",
        algorithm: str | AllReduceAlgorithm = "native",
        compression: Compression = None,
        timeout: float | timedelta = 300.0,
        check_finite: bool = False,
        check_replicas_every: int = 0,
        main_grad_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_can_wrap(module, DistributedDataParallel)
        self.module, self.device_mesh = module, device_mesh
        self.process_group = process_group = data_parallel_group(process_group, device_mesh)
        deadline_s = as_timedelta(timeout)
        self._deadline = new_wrapper_deadline(process_group, deadline_s)
        try:  # a refusal on one rank is raised on every rank, in place of the model check
            self.options = SyncOptions(
                bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view,
                broadcast_buffers=broadcast_buffers, reduction=reduction, algorithm=algorithm,
                compression=compression, timeout=deadline_s, check_finite=check_finite,
                check_replicas_every=check_replicas_every, main_grad_dtype=main_grad_dtype,
            )  # fmt: skip
            self._layouts = grad_layouts(module.named_parameters(), process_group)
            check_main_grad_dtype(main_grad_dtype, gradient_as_bucket_view, self._layouts, module)
        except UsageError as exc:
            refuse_everywhere(exc, self._deadline)
        options = self.options
        self._autotune = AutoBuckets(options.first_bucket_cap_mb) if options.auto else None
        self._make_replicas_equal(options.settings(axis_names(device_mesh)))
        self.reducer = self._first_reducer()
        # torch DDP's switch, honoured as torch honours it: False makes the backward of the next
        # forwards accumulate locally, as inside no_sync() (which sets it). nanoGPT, Lightning
        # and Accelerate set it directly on an accumulation window's micro-steps.
        self.require_backward_grad_sync = True
        self._replicas_checked_at = 0
        self._join_protocol = JoinProtocol(self._deadline)
        self._joining = False

    # -- the settings, as torch DDP exposes them (read-only: they must agree across ranks) ----
    @property
    def reduction(self) -> str:
        return self.options.reduction

    @property
    def broadcast_buffers(self) -> bool:
        return self.options.broadcast_buffers

    @property
    def compression(self) -> Compression:
        return self.options.compression

    @property
    def algorithm(self) -> AllReduceAlgorithm:
        return self.options.all_reduce

    @property
    def timeout(self) -> timedelta:
        return self.options.timeout

    @property
    def check_replicas_every(self) -> int:
        return self.options.check_replicas_every

    @property
    def main_grad_dtype(self) -> torch.dtype | None:
        return self.options.main_grad_dtype

    @property
    def bucket_specs(self) -> list[BucketSpec]:
        """The layout of the buckets in use (``bucket_cap_mb="auto"`` may replace it)."""
        return self.reducer.specs

    def _make_replicas_equal(self, settings: dict[str, Any]) -> None:
        """Check that every rank holds the same model and settings, then copy rank 0's state."""
        named_params = list(self.module.named_parameters())
        named_buffers = list(self.module.named_buffers())
        check_same_model(describe(named_params, named_buffers), settings, self._deadline)
        self._deadline.broadcast(
            [p.data for _, p in named_params] + [b for _, b in named_buffers],
            0,
            "the initial broadcast of rank 0's parameters and buffers",
        )
        self._buffers_to_sync = [b for _, b in named_buffers]

    # -- the reducer: built here, replaced only here -------------------------------------------
    def _first_reducer(self) -> Reducer:
        """Plan the buckets of the trainable parameters and hook them up."""
        options, watch = self.options, ParameterWatch(self.module)
        # named_parameters() already yields a tied parameter once, so it is reduced once.
        named = [(n, p) for n, p in watch.named if p.requires_grad]
        # (numel, dtype) of each trainable parameter's gradient as the buckets hold it.
        sizes = [(local(p).numel(), self.main_grad_dtype or p.dtype) for _, p in named]
        self.bucket_sizes = sizes
        wire = wire_bytes(self.compression, named, sizes)
        self.bucket_cap_mb = resolve_cap(options.bucket_cap_mb, sizes, wire)
        specs = plan_buckets(
            sizes, cap_to_bytes(self.bucket_cap_mb), cap_to_bytes(options.first_bucket_cap_mb)
        )
        device = local(named[0][1]).device if named else torch.device("cpu")
        group = self._deadline.group
        hook = make_comm_hook(
            self.compression, self.algorithm, group, named, grad_dtype=self.main_grad_dtype,
            owner=self.module, keep_undo=options.check_finite,
        )  # fmt: skip
        reduction = Reduction(self.reduction, group, device)
        return Reducer(
            watch, specs, options, deadline=self._deadline, comm_hook=hook,
            reduction=reduction, layouts=self._layouts,
        )  # fmt: skip

    def _replace_reducer(
        self,
        specs: list[BucketSpec],
        *,
        comm_hook: CommHook | None = None,
        sharding: GradientShards | None = None,
    ) -> Reducer:
        """Install a reducer with buckets ``specs`` (and ``comm_hook`` or ``sharding``) that
        continues the current one's step count and open window (``Reducer.succeed``); the
        only way the reducer changes after construction. Only between optimizer steps."""
        self.reducer = Reducer.succeed(self.reducer, specs, comm_hook=comm_hook, sharding=sharding)
        return self.reducer

    def _adopt_plan(self, specs: list[BucketSpec], cap_mb: float | None) -> Reducer:
        """``bucket_cap_mb="auto"``: buckets ``specs``, planned with ``cap_mb``, from now on."""
        self.bucket_cap_mb = cap_mb  # the cap the buckets in use were planned with
        return self._replace_reducer(specs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # no_grad: nothing to synchronise
        self._forward_ran = True
        try:
            self.reducer.check_forward_allowed()
            # Collectives only in training mode: an eval-mode forward, even with grad enabled,
            # may run on rank 0 alone and must not wait for the others.
            training = self.module.training
            num_active = self._before_training_forward(args, kwargs) if training else None
            sync = bool(self.require_backward_grad_sync)
            self.reducer.prepare_for_backward(sync, training, num_active)
        except GradsyncError as exc:
            self._deadline.record_error(exc)  # so that the peers' timeout can name it
            raise
        return self.module(*args, **kwargs)

    def _before_training_forward(self, args: Any, kwargs: Any) -> int | None:
        """The collectives a training forward starts with, the same on every rank; returns the
        number of ranks that still have data inside ``join()`` (``None``: all)."""
        steps = self.reducer.num_reductions
        broadcast = self.broadcast_buffers and bool(self._buffers_to_sync)
        every = self.check_replicas_every
        check_due = every and steps and steps % every == 0 and self._replicas_checked_at != steps
        if self._autotune is not None:  # a step boundary on every rank: may switch the plan
            self._autotune.before_forward(
                self.reducer, self._joining, self.bucket_sizes, self.bucket_cap_mb, self._adopt_plan
            )
        if not (broadcast or self._joining or check_due or not self._first_batch_checked):
            return None  # no collective before this forward
        self._deadline.begin(f"a training forward of step {steps}")
        num_active = None
        if self._joining:
            sync = bool(self.require_backward_grad_sync)
            num_active, _, _ = self._join_protocol.handshake(True, sync, broadcast)
        if not self._first_batch_checked:
            self._first_batch_checked = True
            warn_if_same_batch((args, kwargs), self._deadline)
        if check_due:
            self._replicas_checked_at = steps
            self.check_replicas()
        if broadcast:
            self._broadcast_buffers()
        return num_active

    def _broadcast_buffers(self, src: int = 0) -> None:
        what = f"the broadcast of rank {src}'s buffers before a training forward"
        self._deadline.broadcast(self._buffers_to_sync, src, what)

    def count_items(self, num_items: float) -> None:
        """Declare how many items (samples, valid tokens) this micro-batch's summed loss covers.

        With ``reduction="item_mean"`` the synchronised gradient is the sum over every rank and
        micro-batch of the optimizer step divided by the total of these counts: the exact mean
        over items, however they are split across ranks and accumulation steps. The totals are
        exchanged in one small all-reduce per optimizer step.
        """
        self.reducer.count_items(num_items)

    def check_replicas(self) -> None:
        """Raise ``ReplicaMismatchError`` on every rank unless all replicas are bit-identical.

        Compares parameters, and buffers too when ``broadcast_buffers=False`` (with it, buffers
        are rank 0's at every forward and legitimately differ in between).
        """
        self._parameters_ready()
        named: list[tuple[str, torch.Tensor]] = list(self.module.named_parameters())
        if not self.broadcast_buffers:
            named += list(self.module.named_buffers())
        check_replicas(named, self._deadline)

    @contextmanager
    def join(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Train on uneven data: ranks that finish their batches early wait here for the rest.

        While waiting, a rank takes part in every reduction of the others with zero weight and
        applies the reduced gradients with ``optimizer``, so its parameters and optimizer state
        stay in step; means are over the ranks that still had data, so training equals one
        process trained on exactly the batches that existed. At the end every rank takes the
        parameters and buffers of a rank that was active last. Step logic beyond
        ``optimizer.step()`` (gradient clipping, LR schedulers) does not run on waiting ranks:
        ``check_replicas()`` after the loop tells whether that mattered.
        """
        protocol = self._join_protocol
        protocol.rounds_active = 0
        self._joining = True
        try:
            yield
        except BaseException:
            self._joining = False  # on an error, leave without waiting for the others
            raise
        try:
            protocol.serve_until_done(self.reducer, optimizer, self._broadcast_buffers)
            self._parameters_ready()
            src = protocol.authoritative_rank()
            self._deadline.broadcast(
                [p.data for p in self.module.parameters()] + self._buffers_to_sync,
                src,
                f"the final broadcast of rank {src}'s state at the end of join()",
            )
        finally:
            self._joining = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for forwards run inside this context.

        As in torch DDP the forward decides: the backward of a forward run inside ``no_sync``
        does not communicate, and the next synchronised backward reduces everything
        accumulated, once per bucket. It sets :attr:`require_backward_grad_sync` to ``False``,
        which a training loop may also set itself, as torch DDP allows (nanoGPT does).
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def shard_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
    ) -> ShardedOptimizer:
        """ZeRO-1: an ``optimizer_class(**defaults)`` whose state is sharded over the ranks,
        fed by reduce-scattered buckets, its parameters all-gathered during the next forward
        (see [Note: sharded steps in the wrapper] in ``gradsync/ddp/sharding.py``). The same
        bytes on the wire as plain data parallelism; ``.grad`` stays ``None``: clip with
        ``opt.clip_grad_norm_``. Call it on every rank, once, before the first forward."""
        if self.main_grad_dtype is not None:
            raise UsageError("shard_optimizer() does not support main_grad_dtype yet")
        reducer = self.reducer
        if self._forward_ran or reducer.sharding is not None:
            raise ProtocolError("shard_optimizer() must be called once, before the first forward")
        unsupported = {
            "algorithm": self.algorithm.name != "native",
            "compression": self.compression is not None or self._torch_hook is not None,
            "check_finite": self.options.check_finite,
            "DTensor parameters": any(layout is not None for layout in self._layouts),
            # The optimizer's layout follows the buckets, which "auto" replaces after a few steps.
            "bucket_cap_mb='auto'": self._autotune is not None,
        }
        if any(unsupported.values()):
            bad = ", ".join(k for k, v in unsupported.items() if v)
            raise UsageError(f"shard_optimizer() does not support {bad} yet")
        shards = sharding.shard(
            reducer.specs, reducer.params, reducer.watch.changes(), self._deadline, self.module,
            optimizer_class, defaults,
        )  # fmt: skip
        reducer.watch.count_with(shards.updates)  # each rank steps a different number of slices
        new = self._replace_reducer(reducer.specs, comm_hook=shards.hook, sharding=shards)
        shards.hook.bind(new.buckets, shards.optimizer)
        return shards.optimizer

    def _parameters_ready(self) -> None:
        """Wait for a sharded optimizer's parameter all-gathers (a no-op otherwise)."""
        if self.reducer.sharding is not None:
            self.reducer.sharding.wait_all()

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Run torch's DDP communication hook ``hook(state, bucket) -> Future[Tensor]`` (e.g.
        from ``torch.distributed.algorithms.ddp_comm_hooks``) on every bucket, as
        ``torch.nn.parallel.DistributedDataParallel.register_comm_hook`` does. Call it on
        every rank, once, before the first forward; ranks registering different hooks raise
        ``UsageError`` on every rank. See ``gradsync/comm/torch_hooks.py``."""
        facts = torch_hooks.WrapperFacts(
            describe_compression(self.compression), self.algorithm.name,
            registered=self._torch_hook is not None, forward_ran=self._forward_ran,
            sharded=self.reducer.sharding is not None, auto=self._autotune is not None,
        )  # fmt: skip
        numels = [b.grads.numel() for b in self.reducer.buckets]
        adapter = torch_hooks.register(state, hook, self._deadline, numels, facts)
        self._replace_reducer(self.reducer.specs, comm_hook=adapter)
        self._torch_hook = hook

    def finish_gradient_synchronization(self) -> None:
        """Wait for outstanding reductions; idempotent. Backward already calls it at its end."""
        self.reducer.finish_gradient_synchronization()

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_specs)

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """With ``bucket_cap_mb="auto"``, the plan chosen (``None`` before the switch)."""
        return self._autotune.plan if self._autotune is not None else None

    # -- checkpoints: keys are the unwrapped module's --------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        self._parameters_ready()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        self._parameters_ready()  # a pending all-gather would overwrite what is loaded
        own_keys = self.module.state_dict(keep_vars=True).keys()
        return self.module.load_state_dict(
            strip_prefixes(state_dict, own_keys), strict=strict, assign=assign
        )

    def sync_state_dict(self) -> dict[str, Any]:
        """gradsync's own training state, for a training checkpoint (``state_dict()`` stays
        the module's): the synchronised step counter, the last replica check and the state of
        the compression (PowerSGD's matrices and error buffers; tensors).

        Raises ``ProtocolError`` between the forwards of an accumulation window or inside
        ``join()``: gradients accumulated under ``no_sync()`` are not part of any checkpoint,
        so a checkpoint taken there could not continue the step.
        """
        refuse_mid_step(self.reducer.window_open, self._joining)
        state: dict[str, Any] = {
            "num_reductions": self.reducer.num_reductions,
            "replicas_checked_at": self._replicas_checked_at,
        }
        comm = self.reducer.comm_hook.state_dict()
        if comm:
            state["comm"] = comm
        return state

    def load_sync_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the step counter from a checkpoint (see :meth:`sync_state_dict`).

        A collective (one small all-gather), so that a state one rank cannot load is refused on
        every rank before any rank has changed anything."""
        refuse_mid_step(self.reducer.window_open, self._joining)
        hook = self.reducer.comm_hook
        problem = comm_state_problem(hook, describe_compression(self.compression), state)
        every = self._deadline.gather_objects(problem, "the check of the loaded sync state")
        bad = [f"rank {r}: {p}" for r, p in enumerate(every) if p is not None]
        if bad:
            raise UsageError("cannot load this sync state; nothing was loaded.\n" + "\n".join(bad))
        self.reducer.resume_from(int(state["num_reductions"]))
        self._replicas_checked_at = int(state["replicas_checked_at"])
        if "comm" in state:
            hook.load_state_dict(state["comm"])
