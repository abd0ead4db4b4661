"""Overlapped gradient reduction: the machinery behind :class:`DistributedDataParallel`.

[Note: when a bucket fires]
A post-accumulate-grad hook on every trainable parameter marks its gradient as arrived in its
bucket. When the last gradient of a bucket arrives, the bucket copies them all into its flat
buffer (``buckets.py``) and its communication (an all-reduce by default; see [Note: the bucket
communication seam] in ``comm/hook.py``) is started asynchronously, while autograd goes on
computing earlier layers. Buckets are launched
strictly in index order (a ready bucket waits for its predecessors) because gloo and NCCL match
collectives by the order they are issued: two ranks that launched buckets in different orders
would sum unrelated gradients. At the end of backward (an autograd engine callback), buckets not
launched yet, those holding a parameter that got no gradient in this pass, are filled and
launched, every handle is waited for and the results are written to ``.grad``.

[Note: used flags]
Each bucket carries, after its gradients, one element per parameter: 1 if the parameter got a
gradient on this rank during the accumulation window, else 0. They are summed by the same
all-reduce, so every rank learns, at no extra collective, on how many ranks each parameter was
used. That lets every rank raise the same error for an unused parameter (instead of one rank
erroring while the others hang) and leave the ``.grad`` of a parameter unused everywhere untouched,
exactly as single-process training would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradsync.comm import CommHook
from gradsync.ddp.buckets import AccumulatingBucket, Bucket
from gradsync.ddp.checks import tags
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.checks.readout import read_step, unused_somewhere
from gradsync.ddp.checks.tags import NO_ITEMS, PARAMS_CHANGED, StepTag
from gradsync.ddp.checks.verdicts import (
    StepContext,
    gradient_twice,
    gradient_without_forward,
    judge,
)
from gradsync.ddp.compat.torch_reducer import TorchReducerMethods
from gradsync.ddp.main_grads import start_window
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.tail import TailLayout
from gradsync.ddp.window import Phase, StepWindow
from gradsync.errors import GradsyncError, NonFiniteGradientError, ProtocolError
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout
from gradsync.optim.master import stamp_grads
from gradsync.timing import StepTimeline, slots
from gradsync.timing.ranges import span

# id(parameter) -> the live reducer whose hooks it carries. Wrapping parameters again retires
# the old reducer (removes its hooks): a re-wrap works, and the old wrapper says so if used.
# Weak: an entry goes with its reducer, so this map never keeps a model alive.
_OWNERS: weakref.WeakValueDictionary[int, Reducer] = weakref.WeakValueDictionary()


class Reducer(TorchReducerMethods):
    """Owns the buckets, the hooks and the per-step state of gradient synchronisation.

    It is the only writer of its state and of the current step window ([Note: the step
    window] in ``window.py``): the wrapper tells it about each forward (:meth:`begin_forward`)
    and each rank waiting in ``join()`` (:meth:`shadow_backward`); autograd hooks and the
    end-of-backward callback do the rest.
    """

    _scale: float | None = None  # this backward's pre-division (see Reduction)

    def __init__(
        self,
        watch: ParameterWatch,
        specs: Sequence[BucketSpec],
        options: SyncOptions,
        *,
        deadline: Deadline,
        comm_hook: CommHook,
        reduction: Reduction,
        timeline: StepTimeline,
        layouts: Sequence[GradLayout | None] = (),
    ) -> None:
        # named_parameters() yields a tied parameter once, so it is reduced once.
        trainable = [(n, p) for n, p in watch.named if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.specs = list(specs)
        self.options = options
        self.watch = watch
        self.deadline = deadline
        self.comm_hook = comm_hook
        self.reduction = reduction
        self.timeline, self.marks = timeline, timeline.recorder  # see [Note: step phases]
        # On CUDA a host-side wait blocks until the GPU is done; see Deadline.wait.
        self.host_deadline = not (bool(self.params) and self.params[0].is_cuda)
        self.world_size = deadline.world_size
        self.rank = deadline.rank
        self.layouts = list(layouts) or [None] * len(self.params)  # DTensors only
        self.main_grads = options.main_grads  # see [Note: main gradients] in main_grads.py
        self.tail = self._tail_layout(timeline, len(specs))
        self.buckets = [self._bucket(b, spec) for b, spec in enumerate(specs)]
        if self.buckets:
            self.tail.bind(self.buckets[0].tail)
        self.location = {  # param index -> (bucket index, slot in bucket)
            i: (b, slot) for b, s in enumerate(specs) for slot, i in enumerate(s.param_indices)
        }
        self.window = StepWindow(len(self.params), self.world_size)
        self.retired = False  # a newer reducer (a new wrapper's, or a successor) took over
        self.next_bucket = 0  # the next bucket to launch, in index order
        self.num_reductions = 0  # completed synchronised backward passes, for tests and logs
        # Parameters the first reduction found unused on some rank (see unused_last.py).
        self.first_unused: tuple[int, ...] | None = None
        self._hooks = self._take_over_parameters()

    def _bucket(self, b: int, spec: BucketSpec) -> Bucket:
        kind = AccumulatingBucket if self.main_grads else Bucket
        return kind(
            spec, [self.params[i] for i in spec.param_indices],
            as_view=self.options.gradient_as_bucket_view,
            tail_numel=self.tail.numel if b == 0 else 0,
            layouts=[self.layouts[i] for i in spec.param_indices],
        )  # fmt: skip

    def _tail_layout(self, timeline: StepTimeline, num_buckets: int) -> TailLayout:
        """What rides in bucket 0 after its used flags: [Note: bucket 0's tail] in tail.py."""
        tail = TailLayout(self.world_size, self.rank)
        tail.register(tags.RIDER, tags.NUM_FIELDS)  # [Note: step tags]
        if timeline.enabled:  # every rank's phases of the last interval (timing/slots.py)
            tail.register(slots.RIDER, timeline.width(num_buckets))
        return tail

    def _take_over_parameters(self) -> list[RemovableHandle]:
        for p in self.params:
            previous = _OWNERS.get(id(p))
            if previous is not None and previous is not self:
                previous.retire()
            _OWNERS[id(p)] = self
        # The hooks hold the reducer weakly: a parameter's hooks live in C++, where Python's
        # garbage collector cannot see a cycle through them back to the module.
        me = weakref.ref(self)
        return [
            p.register_post_accumulate_grad_hook(_grad_hook(me, i, *self.location[i]))
            for i, p in enumerate(self.params)
        ]

    @classmethod
    def succeed(
        cls,
        old: Reducer,
        specs: Sequence[BucketSpec],
        *,
        comm_hook: CommHook | None = None,
    ) -> Reducer:
        """A reducer of ``old``'s parameters, options, watch and reduction with other buckets
        (and comm hook, if given); building it retires ``old``. Call it only
        between optimizer steps. It continues:

        - the step count, so that step tags and checkpoints go on (the same parameter watch);
        - the window (the same :class:`StepWindow` object), if one is open. Between a
          reduction and the next training forward no training micro-batch is pending, but an
          eval-mode forward with grad enabled opens a window (see [Note: eval forwards keep
          main gradients] in ``main_grads.py``), and under ``no_sync()`` its backward's
          gradients wait for the next synchronised step. The
          new reducer takes over which parameters were used (without them a parameter that
          only the eval backward reached counts as unused everywhere, and each rank keeps its
          own ``.grad``) and, with main gradients, the gradients themselves;
        - else, with main gradients, every ``p.main_grad``, moved to its new slot.
        """
        new = cls(
            old.watch, specs, old.options, deadline=old.deadline,
            comm_hook=old.comm_hook if comm_hook is None else comm_hook,
            reduction=old.reduction, timeline=old.timeline, layouts=old.layouts,
        )  # fmt: skip
        new.num_reductions = old.num_reductions  # the same watch: step tags continue
        if old.window.phase in (Phase.ACCUMULATING, Phase.ARMED):
            new._continue_window(old)
        elif new.main_grads:
            new._move_main_grads()
        return new

    def _continue_window(self, old: Reducer) -> None:
        self.window = old.window
        if not self.main_grads:
            return  # the window's gradients are in .grad, where autograd put them
        for index, (b, slot) in self.location.items():
            old_b, old_slot = old.location[index]
            self.buckets[b].views[slot].copy_(old.buckets[old_b].views[old_slot])

    def _move_main_grads(self) -> None:
        """Point every ``p.main_grad`` at its slot in this reducer's buckets, keeping its value.

        The reduction writes ``main_grad`` only for parameters used on some rank; one unused
        on every rank keeps the view it had. Left in the retired buckets, which no forward
        zeroes any more, it would hold an old step's gradient for an optimizer to step on,
        where the fixed plan (and one process) gives zeros. (A window an eval forward opened
        is continued instead: ``main_grad`` then holds a copy of the last reduction, not a
        view of the buckets; see [Note: eval forwards keep main gradients].)"""
        for index, param in enumerate(self.params):
            main = getattr(param, "main_grad", None)
            if main is None:
                continue  # never reduced: no main_grad yet, as with the fixed plan
            b, slot = self.location[index]
            view = self.buckets[b].views[slot]
            view.copy_(main)
            param.main_grad = view  # type: ignore[attr-defined]

    def resume_from(self, num_reductions: int) -> None:
        """Continue the step count of a checkpoint whose parameters were loaded on every rank."""
        self.num_reductions = num_reductions
        self.watch.rebase()  # loading wrote the parameters in place on every rank alike

    def retire(self) -> None:
        """Remove this reducer's hooks: a newer reducer of the same parameters replaces it."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.retired = True

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
        if self.main_grads and window.phase is Phase.UNPREPARED:  # a new accumulation window
            start_window(self.buckets, training)  # an eval forward keeps main_grad: see there
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
    def _on_grad_ready(self, index: int, b: int, slot: int) -> None:
        # Runs once per parameter per backward: keep it short (benchmarks/hook_overhead.py).
        window = self.window
        window.used[index] = True
        phase = window.phase
        if phase is Phase.REDUCING:
            pass
        elif phase is Phase.ACCUMULATING:
            if window.backward_began():  # the first gradient: decide() no longer changes it
                self.marks.backward_began()  # under no_sync: its end is marked by a callback
            self.buckets[b].accumulate(slot)  # main gradients add up in the bucket
            return
        elif phase is Phase.UNPREPARED:
            raise gradient_without_forward(self.names[index], self.rank)
        else:  # ARMED: the first gradient of a synchronised backward
            self._start_reduction()
        bucket = self.buckets[b]
        if bucket.ready[slot]:
            raise gradient_twice(self.names[index])
        bucket.arrive(slot)
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _start_reduction(self) -> None:
        self.window.start_reduction()
        self._scale = self._pre_division()
        self.deadline.begin(f"the gradient reduction of step {self.num_reductions}")
        self._write_tail(contributes=True)
        self.reduction.start_item_exchange(contributes=True)
        # Runs once the whole backward pass has finished, on the engine's thread.
        torch.autograd.Variable._execution_engine.queue_callback(
            self.finish_gradient_synchronization
        )

    def _pre_division(self) -> float | None:
        ranks = self.world_size if self.window.by_world else self.window.num_active
        return self.reduction.pre_division(ranks, self.comm_hook.divides_by)

    def _write_tail(self, contributes: bool) -> None:
        """This rank's records in bucket 0's tail; a rank that has joined sends none."""
        if not self.buckets:
            return
        if not contributes:
            self.tail.write({})
            return
        window = self.window
        flags = PARAMS_CHANGED * bool(window.changes) | NO_ITEMS * self.reduction.missing_count
        updates = self.watch.updates_since_wrapping()
        tag = StepTag(self.num_reductions, window.forwards, window.no_sync, updates, flags)
        self.tail.write({
            tags.RIDER: tag.encode(),
            slots.RIDER: self.timeline.outgoing(len(self.specs)),  # the last interval, if any
        })  # fmt: skip

    def _launch_ready_buckets(self) -> None:
        # In index order only; see [Note: when a bucket fires].
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        with span("bucket_copy_in"):
            bucket.gather(self._scale)
        if self.options.check_finite:
            bucket.flag_finite()  # read with the step's readout
        if bucket.filled_late:
            used = self.window.used
            flags = [1.0 if used[i] else 0.0 for i in bucket.spec.param_indices]
            cuda = bucket.buffer.is_cuda  # pinned and non-blocking: the host does not wait
            host = torch.tensor(flags, dtype=bucket.buffer.dtype, pin_memory=cuda)
            bucket.used_flags.copy_(host, non_blocking=cuda)
        else:  # every slot was filled by its hook: all used (no host-to-device copy needed)
            bucket.used_flags.fill_(1.0)
        self.marks.launched(bucket.spec.index)
        with span("bucket_launch"):
            bucket.work = self.comm_hook.start(bucket)

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
        self._write_tail(contributes=False)
        self.reduction.start_item_exchange(contributes=False)
        self._complete(shadow=True, write_back=write_back)

    # -- end of backward: launch the rest, wait, read, check, write back ----------------------
    def _complete(self, shadow: bool, write_back: bool) -> None:
        try:
            self._launch_remaining(zeros=shadow)
            with span("bucket_wait"):
                self._wait_all()
            self.marks.synced()  # the end of the step's collectives: see [Note: step phases]
            with span("step_checks"):
                readout = read_step(
                    self.buckets, self.options.check_finite, self.reduction, self.world_size,
                    self.window.used, self.tail if self.buckets else None,
                )  # fmt: skip
                try:
                    judge(readout, self._step_context())
                except NonFiniteGradientError:
                    self.comm_hook.discard_step()  # the step is skipped: so is its hook state
                    raise
            self.timeline.received(readout.timings, self.num_reductions)
            self.reduction.post_divide([b.grads for b in self.buckets], readout.total_items)
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
            deadline=self.deadline, specs=self.specs, names=self.names, used=window.used,
            num_active=window.num_active, num_reductions=self.num_reductions, watch=self.watch,
            changes=window.changes,
            compare_windows=not self.reduction.counts_items,  # see tags.find_desync
            find_unused_parameters=self.options.tolerates_unused,
        )  # fmt: skip

    def _launch_remaining(self, zeros: bool) -> None:
        # Buckets holding parameters without a gradient in this pass never filled up.
        scale = self._scale = self._pre_division()
        for bucket in self.buckets[self.next_bucket :]:
            for slot in range(len(bucket.params)):
                if not bucket.ready[slot]:
                    bucket.fill_late(slot, scale, zeros=zeros)
        self._launch_ready_buckets()
        assert self.next_bucket == len(self.buckets)

    def _wait_all(self) -> None:
        step = f"step {self.num_reductions}"
        if self.reduction.exchange is not None:
            what = f"the item count ({step})"
            self.deadline.wait(self.reduction.exchange, what, host_deadline=self.host_deadline)
        for bucket in self.buckets:
            assert bucket.work is not None
            what = f"the all-reduce of bucket {bucket.spec.index} ({step})"
            self.deadline.wait(bucket.work, what, host_deadline=self.host_deadline)
        if not self.host_deadline and self.world_size > 1:  # before the readout's host read
            done = torch.cuda.Event()
            done.record()
            self.deadline.wait_device(done, f"the gradient reduction of {step}")

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0
        self.reduction.reset()
        self.window = StepWindow(len(self.params), self.world_size)  # the next step's

    def _write_back(self, counts: list[list[float]]) -> None:
        copies = [c for b, n in zip(self.buckets, counts, strict=True) for c in b.results(n)]
        if copies:  # one call instead of one per parameter
            torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
        if self.main_grads:
            stamp_grads(self.params)  # [Note: clipping main gradients]


def _grad_hook(
    reducer: weakref.ref[Reducer], index: int, b: int, slot: int
) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of trainable parameter ``index`` (slot ``slot`` of bucket
    ``b``): a no-op once its reducer is gone (a wrapper dropped without a successor)."""

    def hook(param: torch.Tensor) -> None:
        owner = reducer()
        if owner is None:
            return
        try:
            owner._on_grad_ready(index, b, slot)
        except GradsyncError as exc:
            owner.deadline.record_error(exc)  # so that the peers' timeout can name it
            raise

    return hook
