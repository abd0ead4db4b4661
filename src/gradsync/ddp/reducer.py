"""Overlapped gradient reduction: the machinery behind :class:`DistributedDataParallel`.

[Note: when a bucket fires]
A post-accumulate-grad hook on every trainable parameter copies its gradient into the flat
buffer of its bucket. When the last gradient of a bucket arrives, the bucket's communication
(an all-reduce by default; see [Note: the bucket communication seam] in ``comm/hook.py``) is
started asynchronously, while autograd goes on computing earlier layers. Buckets are launched
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

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from gradsync.comm import CommHook
from gradsync.ddp.buckets import Bucket, BucketSpec
from gradsync.ddp.deadline import Deadline
from gradsync.ddp.main_grads import stamp_grads, start_window
from gradsync.ddp.param_watch import ParameterWatch
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.results import read_results
from gradsync.ddp.step_checks import (
    check_tags,
    gradient_twice,
    gradient_without_forward,
    nonfinite_params,
    raise_if_unused,
    raise_nonfinite,
)
from gradsync.ddp.step_tags import (
    NO_ITEMS,
    NUM_FIELDS,
    PARAMS_CHANGED,
    StepTag,
    TagSlots,
)
from gradsync.errors import GradsyncError, ProtocolError
from gradsync.mesh.dtensors import GradLayout

if TYPE_CHECKING:
    from gradsync.optim.overlap import GradientShards

# id(parameter) -> the reducer whose hooks it carries. Wrapping parameters again retires the
# old reducer (removes its hooks): a re-wrap works, and the old wrapper says so if used.
_OWNERS: dict[int, weakref.ref[Reducer]] = {}


class _Phase(enum.Enum):
    UNPREPARED = "unprepared"  # no forward through the wrapper since the last reduction
    ACCUMULATING = "accumulating"  # last forward ran under no_sync(): gradients stay local
    ARMED = "armed"  # last forward ran with sync on: the next backward reduces
    REDUCING = "reducing"  # inside that backward: buckets are being launched
    RETIRED = "retired"  # a newer wrapper took these parameters over


class Reducer:
    """Owns the buckets, the hooks and the per-step state of gradient synchronisation.

    It is the only writer of its state: the wrapper tells it about each forward
    (:meth:`prepare_for_backward`) and each rank waiting in ``join()`` (:meth:`shadow_backward`);
    autograd hooks and the end-of-backward callback do the rest.
    """

    _scale: float | None = None  # this backward's pre-division (see Reduction)

    def __init__(
        self,
        watch: ParameterWatch,
        specs: Sequence[BucketSpec],
        *,
        deadline: Deadline,
        comm_hook: CommHook,
        reduction: Reduction,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        check_finite: bool = False,
        layouts: Sequence[GradLayout | None] = (),
        sharding: GradientShards | None = None,
        main_grads: bool = False,
    ) -> None:
        # named_parameters() yields a tied parameter once, so it is reduced once.
        trainable = [(n, p) for n, p in watch.named if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.watch = watch
        self.deadline = deadline
        self.comm_hook = comm_hook
        self.reduction = reduction
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # On CUDA a host-side wait blocks until the GPU is done; see Deadline.wait.
        self.host_deadline = not (bool(self.params) and self.params[0].is_cuda)
        self.check_finite = check_finite
        self.world_size = deadline.world_size
        self.rank = deadline.rank
        num_tags = NUM_FIELDS * self.world_size  # in the first bucket only: [Note: step tags]
        self.layouts = layouts = list(layouts) or [None] * len(self.params)  # DTensors only
        self.sharding = sharding  # see [Note: sharded steps in the wrapper]
        self.main_grads = main_grads  # see [Note: main gradients] in main_grads.py
        self.buckets = [
            Bucket(
                s, [self.params[i] for i in s.param_indices], num_tags * (b == 0),
                [layouts[i] for i in s.param_indices],
                sharding.padded_numels[b] if sharding is not None else None,
                accumulates=main_grads,
            )
            for b, s in enumerate(specs)
        ]  # fmt: skip
        self.location = {  # param index -> (bucket index, slot in bucket)
            i: (b, slot) for b, s in enumerate(specs) for slot, i in enumerate(s.param_indices)
        }
        self.phase = _Phase.UNPREPARED
        self.next_bucket = 0
        self.used = [False] * len(self.params)  # used during the current accumulation window
        self.num_reductions = 0  # completed synchronised backward passes, for tests and logs
        # Ranks that contribute data to the coming reduction: fewer than world_size once some
        # ranks have run out of data and joined (see join.py); they contribute zeros.
        self.num_active = self.world_size
        self.window_forwards = 0  # training forwards in this window (see [Note: step tags])
        self.window_no_sync = 0
        self.changes: list[str] = []  # how the parameter set differs from wrapping time
        self._tag_slots = TagSlots(self.buckets[0].tags, self.rank) if self.buckets else None
        self._local_nonfinite: list[str] = []
        self._hooks = self._take_over_parameters()

    def _take_over_parameters(self) -> list[RemovableHandle]:
        for p in self.params:
            owner = _OWNERS.get(id(p))
            previous = owner() if owner is not None else None
            if previous is not None and previous is not self:
                previous.retire()
            _OWNERS[id(p)] = weakref.ref(self)
        return [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    def resume_from(self, num_reductions: int) -> None:
        """Continue the step count of a checkpoint whose parameters were loaded on every rank."""
        self.num_reductions = num_reductions
        self.watch.rebase()  # loading wrote the parameters in place on every rank alike

    def retire(self) -> None:
        """Remove this reducer's hooks: a newer wrapper of the same parameters replaces it."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.phase = _Phase.RETIRED

    # -- forward side ---------------------------------------------------------------------
    def check_forward_allowed(self) -> None:
        """Raise if a forward now would break the protocol (before any collective is issued)."""
        self.deadline.check_usable()
        if self.phase is _Phase.RETIRED:
            raise ProtocolError(
                "this DistributedDataParallel was replaced by a newer one wrapping the same "
                "parameters; use the new wrapper (the old one no longer synchronises anything)"
            )
        if self.phase is _Phase.REDUCING:
            raise ProtocolError("forward called while a synchronised backward is still running")

    def prepare_for_backward(
        self, sync: bool, training: bool, num_active: int | None = None
    ) -> None:
        """Called by every grad-enabled forward: decides whether its backward reduces, and over
        how many active ranks (``None``: all of them; fewer inside ``join()``). Only
        ``training`` forwards count in the step tag (eval forwards may run on one rank)."""
        self.check_forward_allowed()
        if self.main_grads and self.phase is _Phase.UNPREPARED:  # a new accumulation window
            start_window(self.buckets, training)  # an eval forward keeps main_grad: see there
        self.phase = _Phase.ARMED if sync else _Phase.ACCUMULATING
        self.num_active = self.world_size if num_active is None else num_active
        if training:
            self.window_forwards += 1
            self.window_no_sync += 0 if sync else 1
        self.changes = self.watch.changes()

    def count_items(self, num_items: float) -> None:
        """Declare that the current micro-batch's (sum-reduced) loss covers ``num_items`` items."""
        if self.phase in (_Phase.UNPREPARED, _Phase.REDUCING) and self.reduction.counts_items:
            # After the synchronising backward the count would silently land in the next window.
            raise ProtocolError(
                "call count_items() between a micro-batch's forward and its backward"
            )
        self.reduction.count_items(num_items)

    # -- backward side --------------------------------------------------------------------
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        b, slot = self.location[index]

        def hook(param: torch.Tensor) -> None:
            try:
                self._on_grad_ready(index, b, slot)
            except GradsyncError as exc:
                self.deadline.record_error(exc)  # so that the peers' timeout can name it
                raise

        return hook

    def _on_grad_ready(self, index: int, b: int, slot: int) -> None:
        # Runs once per parameter per backward: keep it short (benchmarks/hook_overhead.py).
        self.used[index] = True
        phase = self.phase
        if phase is _Phase.REDUCING:
            pass
        elif phase is _Phase.ACCUMULATING:
            if self.main_grads:
                self.buckets[b].accumulate(slot)
            return
        elif phase is _Phase.UNPREPARED:
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
        self.phase = _Phase.REDUCING
        self._scale = self.reduction.pre_division(self.num_active)
        self.deadline.begin(f"the gradient reduction of step {self.num_reductions}")
        self._write_tag(contributes=True)
        self.reduction.start_item_exchange(contributes=True)
        # Runs once the whole backward pass has finished, on the engine's thread.
        torch.autograd.Variable._execution_engine.queue_callback(
            self.finish_gradient_synchronization
        )

    def _write_tag(self, contributes: bool) -> None:
        if self._tag_slots is None:
            return
        tag = None
        if contributes:
            flags = PARAMS_CHANGED * bool(self.changes) | NO_ITEMS * self.reduction.missing_count
            updates = self.watch.updates_since_wrapping()
            tag = StepTag(
                self.num_reductions, self.window_forwards, self.window_no_sync, updates, flags
            )
        self._tag_slots.write(tag)

    def _launch_ready_buckets(self) -> None:
        # In index order only; see [Note: when a bucket fires].
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.gather(self.gradient_as_bucket_view, self._scale)
        if self.check_finite:
            self._local_nonfinite += nonfinite_params(bucket, self.names)
        if bucket.filled_late:
            flags = [1.0 if self.used[i] else 0.0 for i in bucket.spec.param_indices]
            bucket.used_flags.copy_(torch.tensor(flags, dtype=bucket.buffer.dtype))
        else:  # every slot was filled by its hook: all used (no host-to-device copy needed)
            bucket.used_flags.fill_(1.0)
        bucket.work = self.comm_hook.start(bucket)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket and write the reduced gradients to ``.grad``.

        Runs by itself at the end of each synchronised backward; calling it again is a no-op.
        """
        if self.phase is not _Phase.REDUCING:
            return
        self._complete(shadow=False, write_back=True)

    def shadow_backward(self, num_active: int, write_back: bool) -> None:
        """Take part in the other ranks' reduction with zeros: this rank has run out of data.

        Issues exactly the collectives of a synchronised backward (see join.py). With
        ``write_back`` the reduced gradients land in ``.grad``, so an optimizer step keeps this
        replica in step with the others.
        """
        self.num_active = num_active
        self.phase = _Phase.REDUCING
        self.used = [False] * len(self.params)
        self.deadline.begin(f"a join round (step {self.num_reductions}, out of data)")
        self._write_tag(contributes=False)
        self.reduction.start_item_exchange(contributes=False)
        self._complete(shadow=True, write_back=write_back)

    # -- end of backward: launch the rest, wait, read, check, write back ----------------------
    def _complete(self, shadow: bool, write_back: bool) -> None:
        try:
            self._launch_remaining(zeros=shadow)
            self._wait_all()
            counts, finite, total_items, tags = read_results(
                self.buckets, self.check_finite, self.reduction, self.world_size, self.used,
                self._tag_slots,
            )  # fmt: skip
            if tags is not None:
                windows = not self.reduction.counts_items  # see step_tags.find_desync
                check_tags(
                    tags, self.deadline, self.num_reductions, self.watch, self.changes, windows
                )
            if finite is not None and not all(finite):
                self.comm_hook.discard_step()
                bad = [b for b, ok in enumerate(finite) if not ok]
                raise_nonfinite(bad, self._local_nonfinite, self.deadline)
            if not self.find_unused_parameters:
                specs = [b.spec for b in self.buckets]
                raise_if_unused(
                    specs, counts, self.names, self.used, self.num_active, self.deadline
                )
            if self.sharding is None:
                self.reduction.post_divide([b.grads for b in self.buckets], total_items)
                if write_back:
                    self._write_back(counts)
            else:  # each rank holds its shard of the reduced gradients, not .grad
                self.reduction.post_divide(self.sharding.grad_shards, total_items)
                self.sharding.receive(self.buckets, counts)
            self.num_reductions += 1
        except GradsyncError as exc:
            self.deadline.record_error(exc)
            raise
        finally:
            self._reset()

    def _launch_remaining(self, zeros: bool) -> None:
        # Buckets holding parameters without a gradient in this pass never filled up.
        scale = self._scale = self.reduction.pre_division(self.num_active)
        for bucket in self.buckets[self.next_bucket :]:
            for slot in range(len(bucket.params)):
                if not bucket.ready[slot]:
                    bucket.filled_late = True
                    bucket.mark_param_as_ready(slot, False, scale, zeros=zeros)
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

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0
        self.used = [False] * len(self.params)
        self.reduction.reset()
        self._local_nonfinite = []
        self.num_active = self.world_size
        self.window_forwards = self.window_no_sync = 0
        self.phase = _Phase.UNPREPARED

    def _write_back(self, counts: list[list[float]]) -> None:
        view = self.gradient_as_bucket_view
        copies = [c for b, n in zip(self.buckets, counts, strict=True) for c in b.results(n, view)]
        if copies:  # one call instead of one per parameter
            torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
        if self.main_grads:
            stamp_grads(self.params)  # [Note: clipping main gradients]
