"""Overlapped gradient reduction: the machinery behind :class:`DistributedDataParallel`.

Buckets launch in index order ([Note: when a bucket fires] in ``launch.py``) and carry a used
flag per parameter ([Note: used flags] in ``buckets.py``); a step's facts live in its window
([Note: the step window] in ``window.py``) and, for every rank, in bucket 0's tail ([Note:
bucket 0's tail] in ``tail.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from gradsync.comm import CommHook
from gradsync.ddp import owners
from gradsync.ddp.buckets import Bucket, write_results
from gradsync.ddp.checks.graph_grads import check_graph_grads, is_graph_grad
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.checks.readout import read_step, unused_somewhere
from gradsync.ddp.checks.tags import TagRider
from gradsync.ddp.checks.verdicts import (
    StepContext,
    gradient_twice,
    gradient_without_forward,
    judge,
)
from gradsync.ddp.compat.torch_reducer import TorchReducerMethods
from gradsync.ddp.hooks import hook_parameters
from gradsync.ddp.launch import LaunchQueue
from gradsync.ddp.main_grads import AccumulatingBucket, move_main_grads
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.tail import Rider, TailLayout
from gradsync.ddp.window import Phase, StepWindow
from gradsync.errors import GradsyncError, NonFiniteGradientError, ProtocolError
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout
from gradsync.optim.master import stamp_grads
from gradsync.timing import StepTimeline
from gradsync.timing.ranges import span
from gradsync.timing.slots import RIDER


class ReducerPlan(NamedTuple):
    """What a reducer is laid out by, besides its parameters and group (``build.py``)."""

    specs: list[BucketSpec]
    sizes: list[tuple[int, torch.dtype]]  # each parameter's gradient as the buckets hold it
    cap_mb: float | None  # the bucket cap the specs were planned with (MiB)
    comm_hook: CommHook
    reduction: Reduction


class Reducer(TorchReducerMethods):
    """Owns the buckets, the hooks and the per-step state of gradient synchronisation.

    It is the only writer of its state and of the current step window ([Note: the step
    window] in ``window.py``): the wrapper's state tells it about each forward
    (:meth:`begin_forward`) and each rank waiting in ``join()`` (:meth:`shadow_backward`);
    autograd hooks and the end-of-backward callback do the rest. One reducer serves a wrapper
    for its whole life: a new bucket plan (:meth:`replan`) or a new group (:meth:`regroup`)
    lays it out again in place. The deterministic mode is a subclass of its own
    (``ddp/leaves.py``): the methods it overrides are the seam's points here.
    """

    takes_grads: str | None = None  # why every .grad is taken into the buckets, if it is
    compares_windows = True  # step tags compare the micro-batches per window ([Note: step tags])

    def __init__(
        self,
        watch: ParameterWatch,
        plan: ReducerPlan,
        options: SyncOptions,
        deadline: Deadline,
        timeline: StepTimeline,
        layouts: Sequence[GradLayout | None] = (),
    ) -> None:
        self.options = options
        self.main_grads = options.main_grads  # see [Note: main gradients] in main_grads.py
        self._hooks: list[RemovableHandle] = []
        self.retired = False  # a newer wrapper's reducer took the parameters over
        self.retired_by: str | None = None
        self.regroup(watch, plan, deadline, timeline, layouts)

    def regroup(
        self,
        watch: ParameterWatch,
        plan: ReducerPlan,
        deadline: Deadline,
        timeline: StepTimeline,
        layouts: Sequence[GradLayout | None] = (),
    ) -> None:
        """Lay the reducer out for ``deadline``'s group, from step 0: at construction, and to go
        on over a new group (``gradsync.recovery``, between steps) in the same object."""
        # named_parameters() yields a tied parameter once, so it is reduced once.
        trainable = [(n, p) for n, p in watch.named if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.watch, self.deadline, self.reduction = watch, deadline, plan.reduction
        self.timeline, self.marks = timeline, timeline.recorder  # see [Note: step phases]
        # On CUDA a host-side wait blocks until the GPU is done; see Deadline.wait.
        self.host_deadline = not (bool(self.params) and self.params[0].is_cuda)
        self.world_size, self.rank = deadline.world_size, deadline.rank
        self.layouts = list(layouts) or [None] * len(self.params)  # DTensors only
        self.window = StepWindow(len(self.params), self.world_size)
        self.num_reductions = 0  # completed synchronised backward passes, for tests and logs
        # The loop's number of the step under way, where a driver of the loop gives one
        # (gradsync.recovery): it rides in the step tag ([Note: step tags] in checks/tags.py).
        self.loop_step: int | None = None
        # Parameters the first reduction found unused on some rank (see unused_last.py).
        self.first_unused: tuple[int, ...] | None = None
        owners.take_over(self)  # retires another wrapper's reducer that had them, if any
        self._lay_out(plan.specs, plan.comm_hook)

    def _lay_out(self, specs: Sequence[BucketSpec], comm_hook: CommHook) -> None:
        """Buckets ``specs`` that travel by ``comm_hook``, and hooks that know their slots."""
        self.specs, self.comm_hook = list(specs), comm_hook
        riders: list[Rider] = [TagRider(), *self.timeline.riders(len(specs))]
        self.tail = TailLayout(self.world_size, self.rank, riders)
        self.buckets = [self._bucket(b, spec) for b, spec in enumerate(specs)]
        self.location = {  # param index -> (bucket index, slot in bucket)
            i: (b, slot) for b, s in enumerate(specs) for slot, i in enumerate(s.param_indices)
        }
        self.queue = LaunchQueue(self.buckets, comm_hook, self.marks, self.options.check_finite)
        for handle in self._hooks:
            handle.remove()
        self._hooks = hook_parameters(self, self.params, self.location)  # weakly: hooks.py

    def _bucket(self, b: int, spec: BucketSpec) -> Bucket:
        params = [self.params[i] for i in spec.param_indices]
        tail_numel = self.tail.numel if b == 0 else 0
        kind = AccumulatingBucket if self.main_grads else Bucket
        return kind(
            spec,
            params,
            as_view=self.options.gradient_as_bucket_view,
            tail_numel=tail_numel,
            layouts=[self.layouts[i] for i in spec.param_indices],
        )

    def replan(self, specs: Sequence[BucketSpec], comm_hook: CommHook | None = None) -> None:
        """Lay the buckets out again as ``specs`` (travelling by ``comm_hook``, if given), between
        optimizer steps. The step count goes on, and so does an open window: an eval-mode
        forward with grad enabled opens one ([Note: eval forwards keep main gradients] in
        ``main_grads.py``), whose used flags and main gradients go on in the new buckets;
        else every ``p.main_grad`` moves to its new slot."""
        window_open = self.window.phase in (Phase.ACCUMULATING, Phase.ARMED)
        old_views = self._views() if self.main_grads else []
        self._lay_out(specs, self.comm_hook if comm_hook is None else comm_hook)
        if not self.main_grads:  # the window's gradients are in .grad, where autograd put them
            return
        if window_open:
            for view, old_view in zip(self._views(), old_views, strict=True):
                view.copy_(old_view)
        else:
            move_main_grads(self.params, self._views())

    def _views(self) -> list[torch.Tensor]:
        """Each trainable parameter's slot in the buckets, in parameter order."""
        where = (self.location[i] for i in range(len(self.params)))
        return [self.buckets[b].views[slot] for b, slot in where]

    def resume_from(self, num_reductions: int) -> None:
        """Continue the step count of a checkpoint whose parameters were loaded on every rank."""
        self.num_reductions = num_reductions
        self.watch.rebase()  # loading wrote the parameters in place on every rank alike

    def retire(self, by: str | None = None) -> None:
        """Remove the hooks: another wrapper's reducer took the parameters over (``by``: its
        call)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.retired, self.retired_by = True, by

    @property
    def reducing(self) -> bool:
        """Inside a synchronised backward: buckets are being launched."""
        return self.window.phase is Phase.REDUCING

    @property
    def unprepared(self) -> bool:
        """No forward through the wrapper since the last reduction."""
        return self.window.phase is Phase.UNPREPARED

    @property
    def window_open(self) -> bool:
        """A training forward ran since the last reduction: gradients of a step are pending."""
        return self.window.open

    # -- forward side ---------------------------------------------------------------------
    def begin_forward(
        self, sync: bool, training: bool, num_active: int | None = None, by_world: bool = False
    ) -> None:
        """Called by every grad-enabled forward: decides whether its backward reduces, and over
        how many active ranks (``None``: all of them; fewer inside ``join()``). Only
        ``training`` forwards count in the step tag (eval forwards may run on one rank). The
        wrapper has refused a forward the reducer cannot take (step 4 of [Note: the forward
        protocol] in ``forward.py``)."""
        window = self.window
        if window.phase is Phase.UNPREPARED:  # a new accumulation window
            for bucket in self.buckets:
                bucket.open_window(training)
        active = self.world_size if num_active is None else num_active
        window.begin_forward(sync, training, active, by_world, self.watch.changes())

    def decide(self, sync: bool) -> None:
        """Whether the backward of the forward just begun reduces (``sync``) or accumulates.

        :meth:`begin_forward` decides from ``require_backward_grad_sync``; the wrapper decides
        again when the flag changes while its module runs, until that forward's backward
        begins: torch decides when the forward returns, and a backward run inside the forward
        (Lightning's manual optimization under ``no_sync()``) goes by the flag at its start.
        """
        self.window.decide(sync)

    def count_items(self, num_items: float | torch.Tensor) -> None:
        """Declare that the current micro-batch's (sum-reduced) loss covers ``num_items`` items."""
        phase = self.window.phase
        if phase in (Phase.UNPREPARED, Phase.REDUCING) and self.reduction.counts_items:
            # After the synchronising backward the count would silently land in the next window.
            raise ProtocolError(
                "call count_items() between a micro-batch's forward and its backward"
            )
        self.reduction.count_items(num_items)

    # -- backward side --------------------------------------------------------------------
    def on_grad_ready(self, index: int, b: int, slot: int) -> None:
        """A gradient hook's call (``hooks.py``): parameter ``index``'s gradient is ready."""
        # Runs once per parameter per backward: keep it short (benchmarks/hook_overhead.py).
        window = self.window
        window.used[index] = True
        phase = window.phase
        if phase is Phase.REDUCING:
            pass
        elif phase is Phase.ACCUMULATING:
            if window.backward_began():  # the first gradient: decide() no longer changes it
                self._accumulation_began()
            self.buckets[b].accumulate(slot)  # main gradients add up in the bucket
            return
        elif phase is Phase.UNPREPARED:
            through_grad = is_graph_grad(self.params[index])
            raise gradient_without_forward(self.names[index], self.rank, through_grad)
        else:  # ARMED: the first gradient of a synchronised backward
            check_graph_grads(self.options, self.buckets, self.takes_grads)
            self._start_reduction()
        bucket = self.buckets[b]
        if bucket.ready[slot]:
            raise gradient_twice(self.names[index])
        bucket.arrive(slot)
        if bucket.pending == 0:  # the queue launches it, and any after it, in index order
            self.queue.launch_ready(window.used)

    def _accumulation_began(self) -> None:
        """The first gradient of a backward under ``no_sync()``."""
        check_graph_grads(self.options, self.buckets, self.takes_grads)  # create_graph=True?
        self.marks.backward_began()  # under no_sync: its end is marked by a callback

    def _start_reduction(self) -> None:
        self.window.start_reduction()
        self.queue.scale = self._pre_division()
        self.deadline.begin(f"the gradient reduction of step {self.num_reductions}")
        self._begin_reduction(contributes=True)
        # Runs once the whole backward pass has finished, on the engine's thread.
        torch.autograd.Variable._execution_engine.queue_callback(
            self.finish_gradient_synchronization
        )

    def _pre_division(self) -> float | None:
        ranks = self.world_size if self.window.by_world else self.window.num_active
        return self.reduction.pre_division(ranks, self.comm_hook.divides_by)

    def _begin_reduction(self, contributes: bool) -> None:
        """What every reduction starts with, a join round's too: each bucket takes a buffer back
        ([Note: handing the buffer over] in ``buckets.py``), then this rank's records go into
        bucket 0's tail (none from a rank that has joined) and the item count out."""
        self._claim_buffers(contributes)
        if self.buckets:
            self.tail.write(self.buckets[0].tail, self if contributes else None)
        self.reduction.start_item_exchange(contributes=contributes)

    def _claim_buffers(self, contributes: bool) -> None:
        for bucket in self.buckets:
            bucket.claim()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket and write the reduced gradients to ``.grad``.

        Runs by itself at the end of each synchronised backward; calling it again is a no-op.
        """
        if self.window.phase is not Phase.REDUCING:
            return
        self.marks.backward_ended()
        self._complete(shadow=False, write_back=True)

    def shadow_backward(self, num_active: int, write_back: bool, by_world: bool = False) -> None:
        """Take part in the other ranks' reduction with zeros: this rank has run out of data.

        Issues exactly the collectives of a synchronised backward (see join.py). With
        ``write_back`` the reduced gradients land in ``.grad``, so an optimizer step keeps this
        replica in step with the others.
        """
        self.window.shadow(num_active, by_world, self.watch.changes())
        self.deadline.begin(f"a join round (step {self.num_reductions}, out of data)")
        self._begin_reduction(contributes=False)
        self._complete(shadow=True, write_back=write_back)

    # -- end of backward: launch the rest, wait, read, check, write back ----------------------
    def _complete(self, shadow: bool, write_back: bool) -> None:
        try:
            # Buckets holding parameters without a gradient in this pass never filled up.
            self.queue.scale = self._pre_division()
            self.queue.launch_rest(zeros=shadow, used=self.window.used)
            with span("bucket_wait"):
                self._wait_all()
            self.marks.synced()  # the end of the step's collectives: see [Note: step phases]
            with span("step_checks"):
                readout = read_step(
                    self.buckets,
                    self.options.check_finite,
                    self.reduction,
                    self.world_size,
                    self.window.used,
                    self.tail if self.buckets else None,
                )
                try:
                    judge(readout, self._step_context())
                except NonFiniteGradientError:
                    self.comm_hook.discard_step()  # the step is skipped: so is its hook state
                    raise
            self.timeline.received(readout.riders.get(RIDER, []), self.num_reductions)
            self._post_divide([b.grads for b in self.buckets], readout.total_items)
            if self.first_unused is None and self.options.tolerates_unused:
                active = self.window.num_active
                self.first_unused = unused_somewhere(self.specs, readout.counts, active)
            if write_back:
                with span("bucket_write_back"):
                    self._write_back(readout.counts)
            self.num_reductions += 1
        except GradsyncError as exc:
            self.marks.abandon()
            self.deadline.record_error(exc)
            raise
        finally:
            self._reset()

    def _step_context(self) -> StepContext:
        window = self.window
        return StepContext(
            deadline=self.deadline,
            specs=self.specs,
            names=self.names,
            used=window.used,
            num_active=window.num_active,
            num_reductions=self.num_reductions,
            loop_step=self.loop_step,
            watch=self.watch,
            changes=window.changes,
            compare_windows=self.compares_windows and not self.reduction.counts_items,
            find_unused_parameters=self.options.tolerates_unused,
        )

    def _post_divide(self, grads: list[torch.Tensor], total_items: float) -> None:
        self.reduction.post_divide(grads, total_items)

    def _wait_all(self) -> None:
        step, host = f"step {self.num_reductions}", self.host_deadline
        if self.reduction.exchange is not None:
            what = f"the item count ({step})"
            self.deadline.wait(self.reduction.exchange, what, host_deadline=host)
        self.queue.wait_all(self.deadline, step, host)

    def _reset(self) -> None:
        self.queue.reset()
        self.reduction.reset()
        self.window = StepWindow(len(self.params), self.world_size)  # the next step's

    def _write_back(self, counts: list[list[float]]) -> None:
        write_results(self.buckets, counts)
        if self.main_grads:
            stamp_grads(self.params)  # [Note: clipping main gradients]
