"""Overlapped gradient reduction: the machinery behind :class:`DistributedDataParallel`.

[Note: when a bucket fires]
A post-accumulate-grad hook on every trainable parameter copies its gradient into the flat
buffer of its bucket. When the last gradient of a bucket arrives, the bucket's all-reduce is
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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import AllReduceAlgorithm, Handle
from gradsync.ddp.buckets import BucketSpec
from gradsync.ddp.deadline import wait_or_raise


class UnusedParametersError(RuntimeError):
    """Some parameter got no gradient on some rank while ``find_unused_parameters=False``."""


class NonFiniteGradientError(RuntimeError):
    """A gradient held NaN or Inf before communication (``check_finite=True``)."""


class _Phase(enum.Enum):
    UNPREPARED = "unprepared"  # no forward through the wrapper since the last reduction
    ACCUMULATING = "accumulating"  # last forward ran under no_sync(): gradients stay local
    ARMED = "armed"  # last forward ran with sync on: the next backward reduces
    REDUCING = "reducing"  # inside that backward: buckets are being launched


class Bucket:
    """One flat buffer of gradients plus a used flag per parameter (see [Note: used flags])."""

    def __init__(self, spec: BucketSpec, params: Sequence[nn.Parameter]) -> None:
        self.spec = spec
        self.params = list(params)
        device = self.params[0].device
        self.buffer = torch.zeros(spec.numel + len(params), dtype=spec.dtype, device=device)
        self.grads = self.buffer[: spec.numel]
        self.used_flags = self.buffer[spec.numel :]
        self.views = [
            self.buffer[off : off + p.numel()].view(p.shape)
            for off, p in zip(spec.offsets, self.params, strict=True)
        ]
        self.work: Handle | None = None
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.filled_late = False  # some slot was filled at the end of backward, not by a hook
        self.work = None

    def mark_param_as_ready(
        self, slot: int, as_view: bool, scale: float | None = None, zeros: bool = False
    ) -> None:
        """Put ``params[slot].grad`` times ``scale`` (zeros if it has none, or if ``zeros``)
        into the buffer. Scaling while copying saves a second pass over the bucket, as torch
        DDP does with its pre-division."""
        assert not self.ready[slot], "a parameter was marked ready twice in one backward"
        param, view = self.params[slot], self.views[slot]
        grad = param.grad
        if grad is None or zeros:
            view.zero_()
        else:
            if grad.data_ptr() != view.data_ptr():
                if scale is None:
                    view.copy_(grad)
                else:
                    torch.mul(grad, scale, out=view)
                if as_view:
                    param.grad = view
            elif scale is not None:
                view.mul_(scale)  # .grad already is the view (gradient_as_bucket_view)
        self.ready[slot] = True
        self.pending -= 1


class Reducer:
    """Owns the buckets, the hooks and the per-step state of gradient synchronisation."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        specs: Sequence[BucketSpec],
        *,
        process_group: dist.ProcessGroup | None,
        algorithm: AllReduceAlgorithm,
        reduction: str,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        timeout: timedelta,
        check_finite: bool = False,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.process_group = process_group
        self.algorithm = algorithm
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
        # reduction="item_mean": items declared on this rank in this window, and the exchange.
        device = self.params[0].device if self.params else torch.device("cpu")
        self.local_items = 0.0
        self._items = torch.zeros(1, dtype=torch.float64, device=device)
        self._items_work: Handle | None = None
        self._local_nonfinite: list[str] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # -- forward side ---------------------------------------------------------------------
    def prepare_for_backward(self, sync: bool) -> None:
        """Called by every grad-enabled forward: decides whether its backward reduces."""
        if self.phase is _Phase.REDUCING:
            raise RuntimeError(
                "gradsync: forward called while a synchronised backward is still running"
            )
        self.phase = _Phase.ARMED if sync else _Phase.ACCUMULATING

    def count_items(self, num_items: float) -> None:
        """Declare that the current micro-batch's (sum-reduced) loss covers ``num_items`` items."""
        if self.reduction != "item_mean":
            raise ValueError(
                f"gradsync: count_items() needs reduction='item_mean' (this wrapper has "
                f"reduction={self.reduction!r})"
            )
        if num_items < 0:
            raise ValueError(f"gradsync: count_items() got a negative count {num_items}")
        if self.phase in (_Phase.UNPREPARED, _Phase.REDUCING):
            # After the synchronising backward the count would silently land in the next window.
            raise RuntimeError(
                "gradsync: call count_items() between a micro-batch's forward and its backward"
            )
        self.local_items += float(num_items)

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
            raise RuntimeError(
                f"gradsync: parameter '{self.names[index]}' got a gradient on rank {self.rank}, "
                "but no forward ran through the DistributedDataParallel wrapper since the last "
                "synchronised backward, so this gradient would never be synchronised. Call the "
                "wrapper (not .module) for training forwards, and run a new forward before each "
                "backward."
            )
        if self.phase is _Phase.ARMED:
            self.phase = _Phase.REDUCING
            self._launch_items_exchange(self.local_items)
            # Runs once the whole backward pass has finished, on the engine's thread.
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish_gradient_synchronization
            )
        b, slot = self.location[index]
        bucket = self.buckets[b]
        if bucket.ready[slot]:
            raise RuntimeError(
                f"gradsync: parameter '{self.names[index]}' produced a gradient twice in one "
                "backward pass (reentrant checkpointing?); this is not supported"
            )
        bucket.mark_param_as_ready(slot, self.gradient_as_bucket_view, self._scale())
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # In index order only; see [Note: when a bucket fires].
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _scale(self) -> float | None:
        # "mean" divides before the sum, as torch DDP does: keeps low-precision sums in range.
        if self.reduction != "mean" or self.num_active == 1:
            return None
        return 1.0 / self.num_active

    def _launch_items_exchange(self, local_items: float) -> None:
        # One small all-reduce per optimizer step, issued before the first bucket on every rank.
        if self.reduction == "item_mean":
            self._items.fill_(local_items)
            self._items_work = dist.all_reduce(self._items, group=self.process_group, async_op=True)

    def _launch(self, bucket: Bucket) -> None:
        if self.check_finite:
            self._check_finite_locally(bucket)
        if bucket.filled_late:
            flags = [1.0 if self.used[i] else 0.0 for i in bucket.spec.param_indices]
            bucket.used_flags.copy_(torch.tensor(flags, dtype=bucket.buffer.dtype))
        else:  # every slot was filled by its hook: all used (no host-to-device copy needed)
            bucket.used_flags.fill_(1.0)
        bucket.work = self.algorithm.all_reduce(bucket.buffer, "sum", self.process_group)

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
        self._launch_items_exchange(0.0)
        self._complete(shadow=True, write_back=write_back)

    def _complete(self, shadow: bool, write_back: bool) -> None:
        try:
            # Buckets holding parameters without a gradient in this pass never filled up.
            for bucket in self.buckets[self.next_bucket :]:
                for slot in range(len(bucket.params)):
                    if not bucket.ready[slot]:
                        bucket.filled_late = True
                        bucket.mark_param_as_ready(slot, False, self._scale(), zeros=shadow)
            if shadow:
                self.used = [False] * len(self.params)
            self._launch_ready_buckets()
            assert self.next_bucket == len(self.buckets)
            step = f"step {self.num_reductions}"
            if self._items_work is not None:
                wait_or_raise(self._items_work, self.timeout, f"the item count ({step})", self.rank)
            for bucket in self.buckets:
                assert bucket.work is not None
                what = f"the all-reduce of bucket {bucket.spec.index} ({step})"
                wait_or_raise(bucket.work, self.timeout, what, self.rank)
            # One device-to-host read for flags and checks (on CUDA a sync point, so only one).
            flags = [b.used_flags for b in self.buckets]
            parts = [
                torch.cat(flags)
                if len({f.dtype for f in flags}) == 1
                else torch.cat([f.to(torch.float64) for f in flags])
            ]
            if self.check_finite:
                parts.append(torch.stack([torch.isfinite(b.grads).all() for b in self.buckets]))
            if self.reduction == "item_mean":
                parts.append(self._items)
            flat = torch.cat([p.to(torch.float64) for p in parts]).tolist()
            counts, start = [], 0
            for bucket in self.buckets:
                counts.append(flat[start : start + len(bucket.params)])
                start += len(bucket.params)
            if self.check_finite:
                finite = flat[start : start + len(self.buckets)]
                start += len(self.buckets)
                if not all(finite):
                    self._raise_nonfinite(finite)
            if not self.find_unused_parameters:
                self._raise_if_unused(counts)
            if self.reduction == "item_mean":
                self._divide_by_items(self._items.item())
            if write_back:
                self._write_back(counts)
            self.num_reductions += 1
        finally:
            for bucket in self.buckets:
                bucket.reset()
            self.next_bucket = 0
            self.used = [False] * len(self.params)
            self.local_items = 0.0
            self._items_work = None
            self._local_nonfinite = []
            self.phase = _Phase.UNPREPARED

    def _divide_by_items(self, total: float) -> None:
        if total <= 0:
            # Every rank read the same total, so every rank raises here.
            raise ValueError(
                "gradsync: reduction='item_mean' but no rank declared any items in this "
                "accumulation window; call model.count_items(n) for every micro-batch"
            )
        for bucket in self.buckets:
            bucket.grads.div_(total)

    def _check_finite_locally(self, bucket: Bucket) -> None:
        # Opt-in: one device-to-host read per bucket, to name the parameters before they mix.
        finite = torch.stack([torch.isfinite(v).all() for v in bucket.views]).tolist()
        self._local_nonfinite += [
            f"{self.names[i]} (bucket {bucket.spec.index})"
            for i, ok in zip(bucket.spec.param_indices, finite, strict=True)
            if not ok
        ]

    def _raise_nonfinite(self, finite: list[float]) -> None:
        # NaN/Inf survive the sum, so every rank sees the same non-finite buckets and arrives.
        per_rank: list[Any] = [None] * self.world_size
        dist.all_gather_object(per_rank, self._local_nonfinite, group=self.process_group)
        bad = [b for b, ok in enumerate(finite) if not ok]
        lines = [f"  rank {r}: {names}" for r, names in enumerate(per_rank) if names]
        raise NonFiniteGradientError(
            f"gradsync: NaN/Inf gradients in bucket(s) {bad} (seen from rank {self.rank}); "
            "before communication they were in:\n" + "\n".join(lines) + "\nParameters are "
            "unchanged. Every rank raised this error, so catching it on every rank and calling "
            "optimizer.zero_grad() skips the step consistently."
        )

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

    def _raise_if_unused(self, counts: list[list[float]]) -> None:
        missing = [
            self.names[i]
            for bucket, bucket_counts in zip(self.buckets, counts, strict=True)
            for i, c in zip(bucket.spec.param_indices, bucket_counts, strict=True)
            if c < self.num_active
        ]
        if not missing:
            return
        # Every rank saw the same counts, so every rank reaches this collective: no hang.
        mine = [self.names[i] for i in range(len(self.params)) if not self.used[i]]
        per_rank: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(per_rank, mine, group=self.process_group)
        lines = [f"  rank {r}: {names}" for r, names in enumerate(per_rank) if names]
        raise UnusedParametersError(
            "gradsync: these parameters received no gradient in this backward pass "
            f"(find_unused_parameters=False), seen from rank {self.rank}:\n"
            + "\n".join(lines)
            + "\nMake every parameter take part in the loss on every rank, freeze the ones you do "
            "not train (requires_grad=False), or pass find_unused_parameters=True to count a "
            "missing gradient as zero."
        )
