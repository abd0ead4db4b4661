"""gradsync's synchronisation for a module sharded with torch's ``fully_shard``.

FSDP2 stays torch's: it shards the parameters over its mesh, all-gathers them for forward and
backward, and reduce-scatters each parameter group's gradients over that mesh. gradsync adds
the other data-parallel axis: after each group's reduce-scatter it all-reduces the group's
gradient shard over the ranks of ``mesh`` (the replicate axis of a hybrid layout across
nodes, or the context-parallel axis, or both flattened), under its deadline, and divides the
sum once by what the reduction means over *every* data-parallel rank.

[Note: scaling]
FSDP2 divides its reduce-scatter by the shard size by default (``ReduceOp.AVG`` on NCCL for
fp32/bf16, a split pre/post division otherwise), and gloo has no ``AVG``. gradsync makes FSDP2
sum instead (``set_force_sum_reduction_for_comms(True)``, ``set_gradient_divide_factor(1.0)``:
no division anywhere, plain ``SUM`` collectives, which gloo has), sums over ``mesh`` itself,
and divides once after both sums: by ``shard size x mesh size`` for ``mean``, by nothing for
``sum``, by the item count of every data-parallel rank for ``item_mean``. One division, after
the sums, is the definition in ``ddp/reduction.py``; in float64 a division by a power of two
is exact, so on such sizes the result has the same bits as torch's own hybrid sharding.

[Note: overlap]
FSDP2 calls the hook (``foreach_reduce`` in torch's ``_fsdp_collectives.py``) with the group's
flat reduce-scatter output, then divides it by the post-division factor (1 here: nothing),
casts it to the parameters' dtype if the reduce dtype differs, and hands each parameter its
slice: a *view* of that output as the new ``.grad``, or an addition into an existing ``.grad``
(a copy), or a copy to the host (CPU offload); then it runs the parameters' post-accumulate-
grad hooks, which read ``.grad``. An all-reduce launched in the hook and waited for later is
therefore only correct while the gradients stay views of the output and nobody reads them
before the wait. gradsync checks exactly that per group (``layout.grads_become_views``): then
it launches the all-reduce asynchronously, keeps the handle and waits for every handle at the
end of backward (an autograd engine callback, queued at the first hook, so it runs after
FSDP2's own end-of-backward callback, which may still reduce the root's group), dividing
there. Otherwise (gradients accumulated into an existing ``.grad`` across optimizer steps, a
reduce dtype that differs, offload, a post-accumulate-grad hook) it waits and divides inside
the hook, which is correct and overlaps nothing. On CPU with gloo the async all-reduce runs on
gloo's own thread while autograd computes the earlier layers, so it overlaps there too.

Accumulation without communication is FSDP2's: ``model.set_requires_gradient_sync(False)``
skips the reduce-scatter, so the hook is not called and gradsync issues nothing either.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradsync.ddp.reduction import Reduction
from gradsync.errors import CollectiveTimeoutError, ProtocolError, UsageError
from gradsync.failfast.deadline import Deadline, Handle, as_timedelta
from gradsync.fsdp import layout
from gradsync.fsdp.timeline import FSDPTimeline
from gradsync.mesh.axes import data_parallel_group
from gradsync.timing.timeline import StepTimeline

_built = 0  # objects built in this process: the same sequence on every rank


def replicate_gradients(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    reduction: str = "mean",
    timeout: float | timedelta = 300.0,
    straggler_every: int = 10,
    deterministic: int | None = None,
) -> ReplicatedGradients:
    """Synchronise the gradients of ``module`` (sharded with ``fully_shard`` over a 1-D mesh)
    over the ranks of ``mesh`` as well, overlapped with backward; call on every rank after
    ``fully_shard`` and before the first backward.

    ``mesh`` is the other data-parallel axis: ``mesh["replicate"]`` for hybrid sharding (shard
    within a node, replicate across nodes), ``mesh["cp"]`` for context parallelism, or several
    axes (``mesh["replicate", "cp"]``). ``reduction`` means what it means for gradsync's
    ``DistributedDataParallel``, over every data-parallel rank (shard x ``mesh``): ``"mean"``,
    ``"sum"`` or ``"item_mean"`` (then call :meth:`ReplicatedGradients.count_items` for every
    micro-batch). gradsync's collectives are waited for under ``timeout`` (seconds); a rank
    that does not arrive is named on the others. Every ``straggler_every`` steps the rank the
    others waited for is named (``ReplicatedGradients.timeline``, as the wrapper's); ``0``
    turns the timeline off. ``deterministic=`` (the wrapper's mode of the same bits at every
    world size) is refused: see :func:`refuse_deterministic`.
    """
    refuse_deterministic(deterministic)
    return ReplicatedGradients(module, mesh, reduction, as_timedelta(timeout), straggler_every)


def refuse_deterministic(leaves: int | None) -> None:
    """The deterministic mode is gradsync's sum of each step's leaves in one fixed tree over the
    data-parallel ranks. Under FSDP2 the first sum of every gradient is FSDP2's reduce-scatter
    over the shard ranks, in the backend's order, which a change of the shard size changes: no
    tree of gradsync's can restore those bits."""
    if leaves is not None:
        raise UsageError(
            "replicate_gradients(deterministic=...) is refused: FSDP2 sums every gradient over "
            "its shard ranks first, in its backend's order, so the bits would change with the "
            "shard size. For the same bits at every world size use "
            "gradsync.DistributedDataParallel(deterministic=...) without fully_shard"
        )


class ReplicatedGradients:
    """The synchronisation :func:`replicate_gradients` installed on one module."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        reduction: str,
        timeout: timedelta,
        straggler_every: int = 10,
    ) -> None:
        global _built
        modules = layout.fsdp_modules(module)
        shard = layout.shard_mesh(modules)
        self.reduction = Reduction(reduction, None, torch.device("cpu"))
        group = data_parallel_group(None, mesh)
        assert group is not None
        layout.check_axes_apart(shard, group, mesh)
        _built += 1
        name = f"replicate_gradients #{_built}"
        # Two private groups: gradsync's all-reduces go over ``mesh``'s ranks; the item counts
        # and the construction check also over the shard ranks (FSDP2's group is torch's).
        self.deadline = Deadline.for_group(group, timeout, name)
        self.shard_deadline = Deadline.for_group(shard.get_group(), timeout, f"{name} (shard)")
        self.process_group = group
        self.divisor = float(shard.size() * dist.get_world_size(group))
        settings = {"reduction": reduction, "straggler_every": str(straggler_every)}
        grid = layout.check_same_everywhere(
            self.deadline, self.shard_deadline, settings, layout.describe(modules)
        )
        fsdp = [m for _, m in modules]
        self.phases = FSDPTimeline(straggler_every, module, fsdp, grid, self.deadline)
        self.steps = 0  # synchronised backwards begun
        self.in_backward = False
        self.pending: list[tuple[Handle, torch.Tensor]] = []
        self.items: torch.Tensor | None = None  # [items, ranks without a count], in flight
        self.item_exchange: Handle | None = None
        self.total_items: float | None = None
        for _, m in modules:
            params = list(layout.managed_parameters(m).values())
            m.set_force_sum_reduction_for_comms(True)  # see [Note: scaling]
            m.set_gradient_divide_factor(1.0)
            m.set_all_reduce_hook(partial(self._on_reduce_scattered, params))

    @property
    def timeline(self) -> StepTimeline:
        """Every data-parallel rank's step phases and the straggler reports: ``report()``,
        ``metrics()``, as on the wrapper (see ``fsdp/timeline.py``)."""
        return self.phases.timeline

    def count_items(self, num_items: float | torch.Tensor) -> None:
        """Declare that the current micro-batch's (sum-reduced) loss covers ``num_items``
        items (``reduction="item_mean"``): its gradient is divided by the total over every
        data-parallel rank and micro-batch of the step."""
        if self.in_backward:
            raise ProtocolError(
                "call count_items() between a micro-batch's forward and its backward"
            )
        self.reduction.count_items(num_items)

    # -- the step's path: FSDP2's hook per group, then the end of backward ---------------------
    def _on_reduce_scattered(self, params: Sequence[torch.Tensor], output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``output`` is one group's reduce-scatter output (summed
        over the shard ranks), laid out as that group's gradient shards."""
        if not self.in_backward:
            self._begin()
        self.deadline.check_usable()
        work = dist.all_reduce(output, group=self.deadline.group, async_op=True)
        assert work is not None
        if layout.grads_become_views(params, output):  # [Note: overlap]
            self.pending.append((work, output))
            return
        self._wait(self.deadline, work, "a gradient all-reduce")
        self._divide([output])

    def _begin(self) -> None:
        """The first group of a synchronised backward: arrival records, the item exchange,
        the end-of-backward callback."""
        self.in_backward = True
        self.steps += 1
        what = f"synchronised backward {self.steps}"
        self.deadline.begin(what)
        if self.reduction.counts_items:
            self.shard_deadline.begin(what)
            r = self.reduction
            self.items = torch.tensor([r.local_items, 0.0 if r.declared else 1.0])
            if r.tensor_counted:
                self.items[:1] += r.device_items.cpu()
            self.item_exchange = dist.all_reduce(
                self.items, group=self.shard_deadline.group, async_op=True
            )
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        """End of backward: wait for every all-reduce still in flight, then divide."""
        try:
            for work, _ in self.pending:
                self._wait(self.deadline, work, "a gradient all-reduce")
            self._divide([output for _, output in self.pending])
            self.phases.exchange(self.deadline, self.shard_deadline, self.steps - 1)
        except BaseException:
            self.phases.abandon()
            raise
        finally:
            self.pending = []
            self.in_backward = False
            self.total_items = None
            self.reduction.reset()

    def _wait(self, deadline: Deadline, work: Handle | None, what: str) -> None:
        """``deadline.wait``, its error saying which global rank each rank it names is: the
        deadline counts ranks within its group, which here is one axis of a larger mesh."""
        assert work is not None
        try:
            deadline.wait(work, what)
        except CollectiveTimeoutError as exc:
            ranks = dist.get_process_group_ranks(deadline.group)
            names = ", ".join(f"{i} is global rank {g}" for i, g in enumerate(ranks))
            axis = "the shard axis" if deadline is self.shard_deadline else "gradsync's axis"
            raise CollectiveTimeoutError(f"{exc} (Ranks counted along {axis}: {names}.)") from exc

    def _divide(self, outputs: list[torch.Tensor]) -> None:
        """Divide the summed gradients by what the reduction means ([Note: scaling])."""
        if not outputs:
            return
        if self.reduction.name == "mean":
            torch._foreach_div_(outputs, self.divisor)
        elif self.reduction.counts_items:
            self.reduction.post_divide(outputs, self._total_items())

    def _total_items(self) -> float:
        """The step's item count over every data-parallel rank: summed over the shard ranks
        (started at the step's first group), then over ``mesh``'s ranks."""
        if self.total_items is None:
            assert self.item_exchange is not None and self.items is not None
            self._wait(self.shard_deadline, self.item_exchange, "the item count")
            self.deadline.check_usable()
            work = dist.all_reduce(self.items, group=self.deadline.group, async_op=True)
            self._wait(self.deadline, work, "the item count")
            if self.items[1] > 0:
                self.total_items = None
                raise UsageError(
                    f"reduction='item_mean' but {int(self.items[1])} data-parallel rank(s) "
                    f"called no count_items() in this step"
                    + (" (this rank among them)" if not self.reduction.declared else "")
                    + "; call it for every micro-batch, with 0 for an empty one"
                )
            self.total_items = float(self.items[0])
        return self.total_items
