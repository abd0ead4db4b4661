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
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommHook
from gradsync.ddp.buckets import Bucket, BucketSpec
from gradsync.ddp.deadline import wait_or_raise
from gradsync.ddp.grad_checks import raise_if_unused, raise_nonfinite
from gradsync.ddp.reduction import Reduction
from gradsync.errors import ProtocolError


class _Phase(enum.Enum):
    UNPREPARED = "unprepared"  # no forward through the wrapper since the last reduction
    ACCUMULATING = "accumulating"  # last forward ran under no_sync(): gradients stay local
    ARMED = "armed"  # last forward ran with sync on: the next backward reduces
    REDUCING = "reducing"  # inside that backward: buckets are being launched


class Reducer:
    """Owns the buckets, the hooks and the per-step state of gradient synchronisation.

    It is the only writer of its state: the wrapper tells it about each forward
    (:meth:`prepare_for_backward`) and each rank that waits inside ``join()``
    (:meth:`shadow_backward`); autograd hooks and the end-of-backward callback do the rest.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        specs: Sequence[BucketSpec],
        *,
        process_group: dist.ProcessGroup | None,
        comm_hook: CommHook,
        reduction: Reduction,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        timeout: timedelta,
        check_finite: bool = False,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.process_group = process_group
        self.comm_hook = comm_hook
        self.reduction = reduction
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        on_cuda = bool(named_params) and named_params[0][1].is_cuda
        self.timeout = None if on_cuda else timeout  # see deadline.wait_or_raise
        self.check_finite = check_finite
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.buckets = [Bucket(s, [self.params[i] for i in s.param_indices]) for s in specs]
        # param index -> (bucket index, slot in bucket)
        self.location: dict[int, tuple[int, int]] = {}
        for b, spec in enumerate(specs):
            for slot, i in enumerate(spec.param_indices):
                self.location[i] = (b, slot)
        self.phase = _Phase.UNPREPARED
        self.next_bucket = 0
        self.used = [False] * len(self.params)  # used during the current accumulation window
        self.num_reductions = 0  # completed synchronised backward passes, for tests and logs
        # Ranks that contribute data to the coming reduction: fewer than world_size once some
        # ranks have run out of data and joined (see join.py); they contribute zeros.
        self.num_active = self.world_size
        self._local_nonfinite: list[str] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # -- forward side ---------------------------------------------------------------------
    def prepare_for_backward(self, sync: bool, num_active: int | None = None) -> None:
        """Called by every grad-enabled forward: decides whether its backward reduces, and over
        how many active ranks (``None``: all of them; fewer inside ``join()``)."""
        if self.phase is _Phase.REDUCING:
            raise ProtocolError("forward called while a synchronised backward is still running")
        self.phase = _Phase.ARMED if sync else _Phase.ACCUMULATING
        self.num_active = self.world_size if num_active is None else num_active

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
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index)

        return hook

    def _on_grad_ready(self, index: int) -> None:
        self.used[index] = True
        if self.phase is _Phase.ACCUMULATING:
            return
        if self.phase is _Phase.UNPREPARED:
            raise ProtocolError(
                f"parameter '{self.names[index]}' got a gradient on rank {self.rank}, "
                "but no forward ran through the DistributedDataParallel wrapper since the last "
                "synchronised backward, so this gradient would never be synchronised. Call the "
                "wrapper (not .module) for training forwards, and run a new forward before each "
                "backward."
            )
        if self.phase is _Phase.ARMED:
            self.phase = _Phase.REDUCING
            self.reduction.start_item_exchange(contributes=True)
            # Runs once the whole backward pass has finished, on the engine's thread.
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish_gradient_synchronization
            )
        b, slot = self.location[index]
        bucket = self.buckets[b]
        if bucket.ready[slot]:
            raise ProtocolError(
                f"parameter '{self.names[index]}' produced a gradient twice in one "
                "backward pass (reentrant checkpointing?); this is not supported"
            )
        scale = self.reduction.pre_division(self.num_active)
        bucket.mark_param_as_ready(slot, self.gradient_as_bucket_view, scale)
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # In index order only; see [Note: when a bucket fires].
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.check_finite:
            self._check_finite_locally(bucket)
        if bucket.filled_late:
            flags = [1.0 if self.used[i] else 0.0 for i in bucket.spec.param_indices]
            bucket.used_flags.copy_(torch.tensor(flags, dtype=bucket.buffer.dtype))
        else:  # every slot was filled by its hook: all used (no host-to-device copy needed)
            bucket.used_flags.fill_(1.0)
        bucket.work = self.comm_hook.start(bucket.buffer, bucket.spec.index)

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
        self.reduction.start_item_exchange(contributes=False)
        self._complete(shadow=True, write_back=write_back)

    # -- end of backward: launch the rest, wait, read, check, write back ----------------------
    def _complete(self, shadow: bool, write_back: bool) -> None:
        try:
            self._launch_remaining(zeros=shadow)
            self._wait_all()
            counts, finite, total_items = self._read_results()
            if finite is not None and not all(finite):
                bad = [b for b, ok in enumerate(finite) if not ok]
                raise_nonfinite(bad, self._local_nonfinite, self.rank, self.process_group)
            if not self.find_unused_parameters:
                self._raise_if_unused(counts)
            self.reduction.post_divide([b.grads for b in self.buckets], total_items)
            if write_back:
                self._write_back(counts)
            self.num_reductions += 1
        finally:
            self._reset()

    def _launch_remaining(self, zeros: bool) -> None:
        # Buckets holding parameters without a gradient in this pass never filled up.
        scale = self.reduction.pre_division(self.num_active)
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
            wait_or_raise(self.reduction.exchange, self.timeout, what, self.rank)
        for bucket in self.buckets:
            assert bucket.work is not None
            what = f"the all-reduce of bucket {bucket.spec.index} ({step})"
            wait_or_raise(bucket.work, self.timeout, what, self.rank)

    def _read_results(self) -> tuple[list[list[float]], list[float] | None, float]:
        """(used counts per bucket, finite flag per bucket or None, global item count).

        One device-to-host read for all of it: on CUDA a sync point, so only one per step.
        """
        parts = [b.used_flags for b in self.buckets]
        if self.check_finite and self.buckets:
            parts.append(torch.stack([torch.isfinite(b.grads).all() for b in self.buckets]))
        if self.reduction.counts_items:
            parts.append(self.reduction.total_items)
        flat = torch.cat([p.to(torch.float64) for p in parts]).tolist() if parts else []
        counts, start = [], 0
        for bucket in self.buckets:
            counts.append(flat[start : start + len(bucket.params)])
            start += len(bucket.params)
        finite = None
        if self.check_finite:
            finite = flat[start : start + len(self.buckets)]
            start += len(self.buckets)
        total_items = flat[start] if self.reduction.counts_items else 0.0
        return counts, finite, total_items

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0
        self.used = [False] * len(self.params)
        self.reduction.reset()
        self._local_nonfinite = []
        self.num_active = self.world_size
        self.phase = _Phase.UNPREPARED

    def _check_finite_locally(self, bucket: Bucket) -> None:
        # Opt-in: one device-to-host read per bucket, to name the parameters before they mix.
        finite = torch.stack([torch.isfinite(v).all() for v in bucket.views]).tolist()
        self._local_nonfinite += [
            f"{self.names[i]} (bucket {bucket.spec.index})"
            for i, ok in zip(bucket.spec.param_indices, finite, strict=True)
            if not ok
        ]

    def _raise_if_unused(self, counts: list[list[float]]) -> None:
        missing = [
            self.names[i]
            for bucket, bucket_counts in zip(self.buckets, counts, strict=True)
            for i, c in zip(bucket.spec.param_indices, bucket_counts, strict=True)
            if c < self.num_active
        ]
        unused_here = [self.names[i] for i in range(len(self.params)) if not self.used[i]]
        raise_if_unused(missing, unused_here, self.rank, self.process_group)

    def _write_back(self, counts: list[list[float]]) -> None:
        copy_dst: list[torch.Tensor] = []
        copy_src: list[torch.Tensor] = []
        for bucket, bucket_counts in zip(self.buckets, counts, strict=True):
            for slot, param in enumerate(bucket.params):
                if bucket_counts[slot] == 0:
                    # Unused on every rank: like single-process training, leave .grad as it was.
                    continue
                view = bucket.views[slot]
                if self.gradient_as_bucket_view:
                    param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    copy_dst.append(param.grad)
                    copy_src.append(view)
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)  # one call instead of one per parameter
