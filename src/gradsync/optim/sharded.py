"""ShardedOptimizer: ZeRO stage 1 over data-parallel ranks, with a plain torch.optim interface.

Each rank keeps the optimizer state (Adam's moments, SGD's momentum) of its equal slice of every
flat bucket only (``layout.py``), steps an ordinary inner optimizer on that slice, and all-gathers
the updated slices so that every rank ends the step with identical full parameters. Memory per
parameter for fp32 Adam goes from 16 bytes to ``8 + 8/d``; the all-gather moves as many bytes as
the second half of a ring all-reduce.

Usage, after any gradient synchronisation::

    opt = gradsync.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); gradsync.average_gradients(model)
    opt.clip_grad_norm_(1.0)      # optional: the global norm, from each rank's slice
    opt.step(); opt.zero_grad()

``step()`` returns with the updated parameters in place on every rank (each bucket's all-gather
is started as soon as its slices are stepped, so it overlaps the step of the next bucket), and
it first checks that every rank is about to step alike: the same hyper-parameters, the same
parameters holding a ``.grad`` (see [Note: optimizer settings agree across ranks] in
``agree.py``); a difference raises ``UsageError`` on every rank, before anything is stepped.

The pieces a data-parallel wrapper needs to reduce-scatter gradients itself:
:attr:`ShardedOptimizer.buckets` (the layout of every flat buffer),
:meth:`~ShardedOptimizer.step_from_shards` (step from reduced gradient slices instead of
``.grad``) and :meth:`~ShardedOptimizer.all_gather_params` with ``async_op=True`` (one handle
per bucket, waited for bucket by bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.errors import GradsyncError, UsageError
from gradsync.optim import agree, clip, state
from gradsync.optim.buffers import FlatBucket, check_optimizer_class
from gradsync.optim.groups import as_param_groups, explicit_buckets, first_difference
from gradsync.optim.layout import DEFAULT_ALIGN, group_by_dtype, plan_shards
from gradsync.optim.mirror import Mirror


class AttachedShards(Protocol):
    """What steps and clips an optimizer that a data-parallel wrapper built (see
    :meth:`ShardedOptimizer.attach`): the same step, under the wrapper's deadline."""

    def step(self) -> None: ...
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)``, its state sharded over ``process_group``.

    Shaped like ``torch.distributed.optim.ZeroRedundancyOptimizer``: ``param_groups`` hold the
    full parameters (LR schedulers, ``add_param_group`` and ``zero_grad`` work on them as
    usual; hyper-parameters are copied to the inner optimizer before each step), ``self.optim``
    is the inner optimizer of this rank's slices. Parameters with ``requires_grad=False`` stay
    listed in ``param_groups`` (so state dicts match torch's) but get no slice and no state. Build
    it on every rank with the same parameters, in the same order (checked: a mismatch raises
    ``UsageError`` on every rank), after moving the model to its device.

    ``optimizer_class`` must be elementwise: SGD (with momentum), Adam, AdamW, Adamax, NAdam,
    RAdam, Adagrad, Adadelta, RMSprop, Rprop and ASGD are; LBFGS, SparseAdam, Adafactor and Muon
    are refused. A custom optimizer cannot be checked: it must update each element from that
    element's gradient and state alone, else results silently differ from unsharded training;
    and, as ``step()`` steps one bucket at a time, keep nothing shared across its parameters that
    a call of its ``step()`` advances (a global step count).

    ``buckets``: an explicit layout, a list of buckets each an ordered list of the parameters
    (each trainable parameter exactly once, one dtype and device per bucket); default: one
    bucket per dtype and device, in parameter order. ``align`` (elements): every rank's slice
    is a multiple of it. Parameters' ``.data`` become views of the flat buffers (see
    [Note: parameters live in the flat buffer]).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        buckets: Sequence[Sequence[torch.Tensor]] | None = None,
        align: int = DEFAULT_ALIGN,
        **defaults: Any,
    ) -> None:
        check_optimizer_class(optimizer_class)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise UsageError(f"align must be a positive number of elements, got {align!r}")
        self.optimizer_class = optimizer_class
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.align = align
        self.buckets: list[FlatBucket] = []
        self._built = False
        self._placeholder_state = False  # see _init_state_for_load
        self._steps = 0  # inner steps taken (the same on every rank)
        self._consolidated: dict[str, Any] | None = None
        # Set when DistributedDataParallel.shard_optimizer built this optimizer: the step runs
        # under the wrapper's deadline, on its process group.
        self._attached: AttachedShards | None = None
        self.mirror: Mirror | None = None  # a buddy's copy of the next rank's slices (Recovery)
        super().__init__(as_param_groups(params), defaults)
        self.optim: torch.optim.Optimizer = optimizer_class([{"params": []}], **defaults)
        self.optim.param_groups.clear()
        self.defaults = dict(self.optim.defaults)
        self._built = True
        self._add_groups(self.param_groups, buckets)

    # -- param groups and layout ---------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as ``torch.optim.Optimizer.add_param_group`` does; its parameters get
        buckets of their own. Call it on every rank alike (it is a collective)."""
        if not self._built:  # torch.optim.Optimizer.__init__ adds the constructor's groups
            super().add_param_group(param_group)
            return
        (group,) = as_param_groups([param_group])
        super().add_param_group(group)
        self._add_groups(self.param_groups[-1:], None)

    def _add_groups(
        self, groups: list[dict[str, Any]], buckets: Sequence[Sequence[torch.Tensor]] | None
    ) -> None:
        """Plan the buckets of ``groups``' parameters, check every rank agrees, and give the
        inner optimizer one group of this rank's slices per group."""
        if buckets is not None:
            members = explicit_buckets(self.param_groups, buckets)
        else:
            members = [
                [trainable[i] for i in b]
                for g in groups
                for trainable in [[p for p in g["params"] if p.requires_grad]]
                for b in group_by_dtype(trainable)
            ]
        self._check_same_everywhere(members)
        layouts = plan_shards(
            [[p.numel() for p in m] for m in members], self.world_size, self.align
        )
        for m, layout in zip(members, layouts, strict=True):
            self.buckets.append(FlatBucket(len(self.buckets), m, layout, self.rank))
        for g in groups:
            mine = {id(p) for p in g["params"]}
            slices = [
                s
                for b in self.buckets
                for pc, s in zip(b.pieces, b.slices, strict=True)
                if id(b.params[pc.param]) in mine
            ]
            self.optim.add_param_group({**state.hyperparameters(g), "params": slices})
            for k, v in self.optim.param_groups[-1].items():
                g.setdefault(k, v)  # the inner optimizer's defaults, visible to schedulers

    def _check_same_everywhere(self, members: list[list[Any]]) -> None:
        """One object gather: every rank must lay out the same parameters the same way."""
        if self.world_size == 1:
            return
        mine = (
            self.optimizer_class.__name__,
            self.align,
            [[(tuple(p.shape), str(p.dtype)) for p in m] for m in members],
        )
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        for r, theirs in enumerate(everyone):
            if theirs[:2] != everyone[0][:2]:
                raise UsageError(
                    f"ShardedOptimizer settings differ: rank 0 has (optimizer, align) "
                    f"{everyone[0][:2]}, rank {r} has {theirs[:2]}"
                )
            if theirs[2] != everyone[0][2]:
                raise UsageError(
                    f"ShardedOptimizer got different parameters on different ranks: "
                    f"{first_difference(everyone[0][2], theirs[2], r)}"
                )

    def _sync_hyperparameters(self) -> None:
        """Copy every outer group's hyper-parameters (an LR scheduler's ``lr``...) inward."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update(state.hyperparameters(outer))

    # -- stepping ------------------------------------------------------------------------------
    def attach(self, shards: AttachedShards) -> None:
        """Let ``shards`` step and clip this optimizer, on a wrapper's process group and under
        its deadline (``DistributedDataParallel.shard_optimizer`` calls this; see [Note:
        sharded steps in the wrapper] in ``gradsync/ddp/sharding.py``)."""
        self._attached = shards

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's slices from the parameters' ``.grad`` (already synchronised across
        ranks) and all-gather them: every rank returns holding the same updated parameters. A
        parameter whose ``.grad`` is ``None`` is not stepped, as by a torch optimizer. First
        every rank checks that all are about to step alike (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._attached is not None:  # see [Note: sharded steps in the wrapper]
            self._attached.step()
            return loss
        self.check_step(self._dist_peers())
        for work in self.step_and_gather(self._start_gather):
            if work is not None:
                work.wait()
        return loss

    def check_step(self, peers: agree.Peers | None, *, grads: bool = True) -> None:
        """Raise on every rank (one small all-reduce over ``peers``) unless every rank is about
        to step with the same hyper-parameters and (``grads``) the same parameters holding a
        ``.grad``, and no rank's own checks refuse: see [Note: optimizer settings agree across
        ranks] in ``agree.py``."""
        refused = None
        try:
            if grads:
                self._check_frozen_have_no_grad()
            for b in self.buckets:
                b.check_params("ShardedOptimizer.step")
            if self.mirror is not None:
                self.mirror.check()
        except GradsyncError as exc:
            refused = exc
        alone = self.world_size == 1
        name = self.optimizer_class.__name__
        where = "ShardedOptimizer.step()"
        agree.check_step(
            where, name, self.param_groups, refused, None if alone else peers, grads=grads
        )

    def step_and_gather(self, start_gather: Callable[[FlatBucket], Any]) -> list[Any]:
        """Step each bucket's slices from the parameters' ``.grad`` and, as soon as they are
        stepped, ``start_gather(bucket)`` (its all-gather, asynchronous), so that the gather of
        one bucket overlaps the step of the next. Returns the handles, one per bucket (``None``:
        nothing to wait for); wait for all before anything reads the parameters."""
        self._begin_inner_step()
        handles = []
        for b in self.buckets:
            b.attach_param_grads()
            try:
                self.optim.step()  # steps the slices that have a gradient: this bucket's
            finally:
                b.detach_grads()
            handles.append(start_gather(b))
        return handles

    def _start_gather(self, b: FlatBucket) -> dist.Work | None:
        if self.world_size == 1:
            return None
        return dist.all_gather_into_tensor(b.data, b.shard, group=self.process_group, async_op=True)

    def _dist_peers(self) -> agree.Peers:
        return agree.dist_peers(self.process_group, self.buckets[0].data.device)

    def _check_frozen_have_no_grad(self) -> None:
        """A parameter frozen at construction is in no bucket: if it has a gradient now
        (``requires_grad`` turned on later) it would silently never train."""
        bucketed = {id(p) for b in self.buckets for p in b.params}
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                if p.grad is not None and id(p) not in bucketed:
                    raise UsageError(
                        f"parameter {pi} of param group {gi} (shape {list(p.shape)}) has a "
                        f"gradient but did not require grad when ShardedOptimizer was built, so "
                        f"it has no slice to train; build the optimizer after unfreezing it"
                    )

    @torch.no_grad()
    def step_from_shards(
        self, grad_shards: Sequence[torch.Tensor], *, skip: Iterable[torch.Tensor] = ()
    ) -> None:
        """Step this rank's slices from ``grad_shards[i]``, its reduced slice of bucket ``i``'s
        flat gradient (the output of a ``reduce_scatter`` of the padded flat gradients, already
        divided by the world size for a mean; padding must be zero for clipping). ``.grad`` is
        not read. Parameters in ``skip`` (no gradient on any rank) are left as they are.
        Parameters are stale until :meth:`all_gather_params` has run. Like :meth:`step`, it
        first checks that every rank steps with the same hyper-parameters (a collective)."""
        if len(grad_shards) != len(self.buckets):
            raise UsageError(
                f"step_from_shards needs one gradient shard per bucket ({len(self.buckets)}), "
                f"got {len(grad_shards)}"
            )
        self.check_step(self._dist_peers(), grads=False)
        skipped = {id(p) for p in skip}
        for b, g in zip(self.buckets, grad_shards, strict=True):
            b.attach_shard_grads(g, skipped)
        self._begin_inner_step()
        try:
            self.optim.step()
        finally:
            for b in self.buckets:
                b.detach_grads()

    def _begin_inner_step(self) -> None:
        if self._placeholder_state:  # state made only to receive a checkpoint that never came
            self.optim.state.clear()
            self._placeholder_state = False
        self._sync_hyperparameters()
        self._steps += 1

    def all_gather_params(self, *, async_op: bool = False) -> list[dist.Work | None]:
        """All-gather every bucket's updated slices into its flat buffer, i.e. the parameters.

        One collective per bucket, in bucket order, on every rank. With ``async_op=True`` the
        returned list holds one handle per bucket: wait for ``handles[i]`` before anything reads
        a parameter of bucket ``i`` (:meth:`bucket_index`), and keep every handle until it has
        been waited for. With one rank there is nothing to gather (``None`` handles).
        """
        handles: list[dist.Work | None] = []
        for b in self.buckets:
            if self.world_size == 1:
                handles.append(None)
                continue
            work = dist.all_gather_into_tensor(
                b.data, b.shard, group=self.process_group, async_op=async_op
            )
            handles.append(work)
        return handles

    def bucket_index(self, param: torch.Tensor) -> int:
        """The bucket that holds ``param`` (whose all-gather handle to wait for)."""
        for b in self.buckets:
            if any(p is param for p in b.params):
                return b.index
        raise UsageError(f"a parameter of shape {list(param.shape)} is not in this optimizer")

    # -- clipping ------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the parameters' ``.grad`` by their global norm, like
        ``torch.nn.utils.clip_grad_norm_`` on every parameter, computed from this rank's slices
        only (each element counted once over the group) plus one scalar all-reduce."""
        if self._attached is not None:  # the wrapper's .grad is replicated: see attach()
            return self._attached.clip_grad_norm_(max_norm, norm_type)
        grads = []
        for b in self.buckets:
            for pc in b.pieces:
                g = b.params[pc.param].grad
                if g is not None:
                    grads.append(g.reshape(-1)[pc.start : pc.end])
        device = self.buckets[0].data.device
        # None means "this rank's alone" to clip.total_norm, "the default group" here.
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        total = clip.total_norm(grads, norm_type, process_group=group, device=device)
        full = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        clip.clip_grads_with_norm_(full, max_norm, total)
        return total

    # -- state dicts (state.py) ----------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank ``to``, one parameter at a time (collective)."""
        self._consolidated = state.consolidate(self, to)

    def state_dict(self) -> dict[str, Any]:
        """The consolidated full state dict (``torch.optim.AdamW``'s shape) on the rank given to
        :meth:`consolidate_state_dict`; for checkpoints that reshard use
        :meth:`sharded_state_dict` with ``torch.distributed.checkpoint``."""
        if self._consolidated is None:
            raise UsageError(
                f"rank {self.rank}: ShardedOptimizer.state_dict() needs "
                f"consolidate_state_dict(to=...) first, on every rank; only that rank gets it "
                f"(or use sharded_state_dict() with torch.distributed.checkpoint)"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (unsharded) state dict on every rank; each keeps its own slices."""
        had_state = state.load_full(self, state_dict)
        self._steps = max(self._steps, 1) if had_state else 0
        self._placeholder_state = False
        if self.mirror is not None:
            self.mirror.sync(self.process_group)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's state for ``torch.distributed.checkpoint`` save and load (see
        :func:`gradsync.optim.state.sharded_state_dict`)."""
        if self._steps == 0 and not self.optim.state:
            self._init_state_for_load()
        return state.sharded_state_dict(self)

    def _init_state_for_load(self) -> None:
        """Before any step there is no state to load into: create it with one step on zero
        gradients, then put the parameters back. It is marked a placeholder: the first real
        step discards it unless a checkpoint was loaded into it (torch's
        ``get_optimizer_state_dict`` makes state the same way, but keeps it)."""
        self._sync_hyperparameters()
        state.step_on_zeros(self)
        self._placeholder_state = True

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finish a DCP load into :meth:`sharded_state_dict`'s dict (hyper-parameters)."""
        self._steps = state.load_sharded(self, state_dict)
        self._placeholder_state = False
        if self.mirror is not None:  # the buddy mirrors the loaded state (a collective)
            self.mirror.sync(self.process_group)

    @property
    def steps(self) -> int:
        """Inner optimizer steps taken (the same on every rank)."""
        return self._steps
