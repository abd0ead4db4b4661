"""Buckets: the flat buffer a planned bucket (``plan.py``) shares, and how gradients get in
and out of it.

A bucket's buffer holds its gradients, then one used flag per parameter (see [Note: used
flags] below) and, in the first bucket, every rank's records of the step (see
[Note: bucket 0's tail] in ``tail.py``). :class:`Bucket` copies each gradient in once its
whole bucket has arrived, and after the sum hands large gradients' buffer over rather than
copying out of it (see [Note: handing the buffer over] below); ``AccumulatingBucket``
(``main_grad_dtype``, in ``main_grads.py``) owns the gradients instead, adding each
micro-batch's into its buffer as it arrives (see [Note: main gradients] there).

[Note: used flags]
Each bucket carries, after its gradients, one element per parameter: 1 if the parameter got a
gradient on this rank during the accumulation window, else 0. They are summed by the same
all-reduce, so every rank learns, at no extra collective, on how many ranks each parameter was
used. That lets every rank raise the same error for an unused parameter (instead of one rank
erroring while the others hang) and leave the ``.grad`` of a parameter unused everywhere
untouched, exactly as single-process training would.

[Note: handing the buffer over]
Once a bucket is summed, torch DDP copies each reduced gradient out of the bucket into
``.grad``: a pass over every gradient byte per step (5 ms of a 220 ms step of the bench's GPT
on one CPU core). Where nobody can hold the ``.grad`` being replaced, the copy is not needed:
``.grad`` becomes the buffer's view of that gradient (:meth:`Bucket.results`). Nobody holds it
when the parameter has no ``.grad``, or when autograd made its ``.grad`` in this window: the
parameter had none when the window's first forward ran (:meth:`Bucket.open_window`), as after
``zero_grad()``, whose default sets ``.grad`` to ``None``. A ``.grad`` that was there before
(``zero_grad(set_to_none=False)``, a tensor the user assigned and may keep) is written in
place, as torch does, and so is one that is not contiguous (the view is; autograd's follows the
parameter's layout) or that has a graph ([Note: gradients with a graph] in
``checks/graph_grads.py``).

A bucket hands its buffer over only where that saves host time: on a CPU (on a GPU the copy
is the device's work, one batched call for the host, while every view laid out again is the
host's), and only where its parameters are large, at least ``HAND_OVER_BYTES`` a parameter on
average. A view costs the host a few microseconds to lay out each step; copying a parameter of
a few hundred bytes costs less, so a bucket of many small parameters copies (``hands_over``).

The bucket keeps no view of a buffer it handed over. When the next reduction begins, it takes
a buffer back (:meth:`Bucket.claim`): the same memory if no gradient refers to it any more, as
after ``zero_grad()``, else new memory. Reusing it matters on a CPU, where a large buffer of
new memory costs a page fault per 4 KiB on its first write (one 50 MB bucket made the step 7 %
slower than copying).

The values are the same bits either way, and the handed-over buffer belongs to the
gradients alone from then on, so no later step writes into a ``.grad`` anyone kept. What a
user can see: the ``.grad`` of one bucket's parameters share one storage, as with
``gradient_as_bucket_view`` (``torch.save`` of one gradient writes the whole storage), and
each step's ``.grad`` is a new tensor, as it is under torch DDP after ``zero_grad()``. Memory
is torch's too: the buffer handed over replaces the gradients autograd made, which are freed,
and the bucket holds no second buffer while the gradients hold the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from gradsync.ddp.plan import BucketSpec
from gradsync.mesh.dtensors import GradLayout, local

# A view laid out again after a hand-over costs the host about 3 us (the split's share and
# ``Tensor.view``); a copy on a CPU moves 5-10 GB/s: at 64 KiB a parameter the copy costs more.
HAND_OVER_BYTES = 64 * 1024


def _unshared(buffer: torch.Tensor) -> bool:
    """Whether no tensor but ``buffer`` refers to its memory (no view of it is alive). torch has
    no public call for this; without its private one, the answer is no: new memory."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(buffer.untyped_storage()._cdata) == 2)  # buffer's; the storage object's


class Bucket:
    """One flat buffer of gradients plus a used flag per parameter, and its fill state.

    Each gradient is copied in (times the pre-division) once the whole bucket has arrived
    (:meth:`gather`), and the reduced gradients are copied back out (:meth:`results`). A
    DTensor parameter (``layouts[slot]`` is its :class:`~gradsync.mesh.dtensors.GradLayout`)
    occupies the size of its local shard and gets its reduced gradient back as a DTensor.
    ``as_view`` (``gradient_as_bucket_view``): ``.grad`` becomes a view of the buffer.
    """

    def __init__(
        self,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        *,
        as_view: bool = False,
        tail_numel: int = 0,
        layouts: Sequence[GradLayout | None] | None = None,
    ) -> None:
        self.spec = spec
        self.params = list(params)
        self.as_view = as_view
        self.layouts = list(layouts) if layouts is not None else [None] * len(self.params)
        self.shapes = [local(p).shape for p in self.params]
        self.numels = [local(p).numel() for p in self.params]
        # Slots whose .grad may become a view of the buffer: see [Note: handing the buffer over].
        device = self.params[0].device
        per_param = spec.numel * spec.dtype.itemsize / max(len(self.params), 1)
        self.large = per_param >= HAND_OVER_BYTES  # passes over memory cost more than calls
        self.hands_over = device.type == "cpu" and self.large
        # No DTensor, not gradient_as_bucket_view: gradients in and out in one batched call.
        self.simple = not as_view and all(layout is None for layout in self.layouts)
        plain = [layout is None and not as_view for layout in self.layouts]
        self.plain = [self.hands_over and p for p in plain]
        self.fresh = [False] * len(self.params)  # no .grad when the window opened: open_window
        self.spare: torch.Tensor | None = None  # the buffer handed over, until claim()
        n = spec.numel + len(params) + tail_numel
        self._lay_out(torch.zeros(n, dtype=spec.dtype, device=device))
        self.work: Any = None  # the handle of this bucket's communication, once launched
        self.reset()

    def _lay_out(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` this bucket's: its gradients' views, used flags and tail."""
        n, n_flags = self.spec.numel, len(self.params)
        self.buffer = buffer
        self.grads = buffer[:n]
        self.used_flags = buffer[n : n + n_flags]
        self.tail = buffer[n + n_flags :]  # bucket 0 only: see [Note: bucket 0's tail]
        # The plan packs the gradients back to back (offsets are running sums of numels).
        pieces = self.grads.split(self.numels)
        self.views = [v.view(s) for v, s in zip(pieces, self.shapes, strict=True)]

    def open_window(self, training: bool) -> None:
        """A new accumulation window begins (its first grad-enabled forward): note which
        parameters have no ``.grad`` now ([Note: handing the buffer over]); only a bucket that
        hands over asks (a ``.grad`` read is a few hundred nanoseconds, per parameter)."""
        if self.hands_over:
            self.fresh = [p.grad is None for p in self.params]

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.arrived: list[int] = []  # slots whose hook fired, not copied in yet (see gather)
        self.filled_late = False  # some slot was filled at the end of backward, not by a hook
        self.work = None
        self.local_finite: torch.Tensor | None = None  # see flag_finite

    def flag_finite(self) -> None:
        """Note, on the device, which gradients in the buffer are finite before the sum mixes
        them (``check_finite``): read with the step's readout, so no host read per bucket."""
        self.local_finite = torch.stack([torch.isfinite(v).all() for v in self.views])

    def write_used_flags(self, used: Sequence[bool]) -> None:
        """This rank's used flags for the sum; ``used``: the window's, per trainable parameter
        (indexed like the reducer's parameters)."""
        if self.filled_late:
            flags = [1.0 if used[i] else 0.0 for i in self.spec.param_indices]
            cuda = self.buffer.is_cuda  # pinned and non-blocking: the host does not wait
            host = torch.tensor(flags, dtype=self.buffer.dtype, pin_memory=cuda)
            self.used_flags.copy_(host, non_blocking=cuda)
        else:  # every slot was filled by its hook: all used (no host-to-device copy needed)
            self.used_flags.fill_(1.0)

    # -- in: from autograd's hooks, then at the end of backward ------------------------------
    def arrive(self, slot: int) -> None:
        """``params[slot]``'s hook fired: its gradient is final for this backward. The copy
        into the buffer waits for :meth:`gather`, once the whole bucket has arrived."""
        self.ready[slot] = True  # _mark_ready's, inline: this runs once per parameter
        self.pending -= 1
        self.arrived.append(slot)

    def _mark_ready(self, slot: int) -> None:
        self.ready[slot] = True
        self.pending -= 1

    def accumulate(self, slot: int) -> None:
        """``params[slot]``'s hook fired under ``no_sync()``: autograd keeps adding the window's
        gradients into ``.grad``, where they stay until the synchronised backward."""

    def gather(self, scale: float | None) -> None:
        """Copy (times ``scale``) every arrived gradient into the buffer: one ``_foreach_copy_``
        and one ``_foreach_mul_`` for the bucket instead of a copy per hook, which is what
        keeps the per-parameter cost of the hook path low (a kernel launch each, on a GPU)."""
        if self.simple:
            grads = [self.params[slot].grad for slot in self.arrived]
            if not any(g is None or g.requires_grad for g in grads):  # the common case
                whole = len(grads) == len(self.params)  # none filled late: all of self.grads
                present = cast(list[torch.Tensor], grads)  # checked above: none is None
                self._scaled_copy([self.views[s] for s in self.arrived], present, scale, whole)
                self.arrived = []
                return
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        in_place: list[torch.Tensor] = []  # .grad already is the view (gradient_as_bucket_view)
        for slot in self.arrived:
            param, view = self.params[slot], self.views[slot]
            grad = param.grad
            if grad is not None and grad.requires_grad:  # create_graph=True: the values only
                grad = grad.detach()  # ([Note: gradients with a graph] in graph_grads.py)
            if self.layouts[slot] is not None or grad is None:
                self._copy_in(slot, scale, self.as_view)  # DTensor: [Note: Partial gradients]
            elif self.as_view and grad.data_ptr() == view.data_ptr():
                in_place.append(view)  # only with as_view can .grad be the bucket's view
            else:
                dst.append(view)
                src.append(grad)
                if self.as_view:
                    param.grad = view
        self.arrived = []
        self._scaled_copy(dst, src, scale)
        if scale is not None and in_place:
            torch._foreach_mul_(in_place, scale)

    def _scaled_copy(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        scale: float | None,
        whole: bool = False,
    ) -> None:
        """``dst[i] = src[i] * scale``, the same bits whichever way: one rounding of the
        product. Large gradients on a CPU, where the passes over memory cost and not the
        calls, are multiplied into the buffer one by one (each element read and written once,
        where a copy and then a multiply write it twice); the rest are copied in one batched
        call and multiplied in one more: the whole gradient region at once where ``dst``
        covers it (``whole``; a CPU's batched calls are a loop over the tensors)."""
        if not dst:
            return
        if scale is not None and self.large and self.buffer.device.type == "cpu":
            for d, s in zip(dst, src, strict=True):
                torch.mul(s, scale, out=d)
            return
        torch._foreach_copy_(dst, src)
        if scale is not None and whole:
            self.grads.mul_(scale)
        elif scale is not None:
            torch._foreach_mul_(dst, scale)

    def fill_late(self, slot: int, scale: float | None, zeros: bool = False) -> None:
        """Put ``params[slot].grad`` times ``scale`` (zeros if it has none, or if ``zeros``)
        into the buffer now: for a slot filled at the end of backward, not by its hook."""
        assert not self.ready[slot], "a parameter was marked ready twice in one backward"
        self.filled_late = True
        self._copy_in(slot, scale, False, zeros)
        self._mark_ready(slot)

    def _copy_in(
        self, slot: int, scale: float | None, view_grad: bool, zeros: bool = False
    ) -> None:
        # Scaling while copying saves a second pass over the gradient, as torch DDP does with
        # its pre-division.
        param, view, layout = self.params[slot], self.views[slot], self.layouts[slot]
        grad = param.grad
        if grad is None or zeros:
            view.zero_()
            return
        if layout is not None:
            grad = layout.local_grad(grad)  # see [Note: Partial gradients]
        grad = grad.detach()  # create_graph=True: the values only (checks/graph_grads.py)
        if grad.data_ptr() != view.data_ptr():
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            if view_grad:
                param.grad = view if layout is None else layout.wrap(view)
        elif scale is not None:
            view.mul_(scale)  # .grad already is the view (gradient_as_bucket_view)

    # -- out: the reduced gradients ----------------------------------------------------------
    def results(self, counts: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give every parameter used on some rank (``counts``) its reduced gradient: the
        buffer's view where it can be handed over, else a copy; returns the ``(destination,
        source)`` pairs of the copies, to be done in one batch."""
        if self.simple and not self.hands_over and all(counts):
            grads = [p.grad for p in self.params]
            if all(g is not None for g in grads):  # the common case: one pair per gradient
                return list(zip(cast(list[torch.Tensor], grads), self.views, strict=True))
        copies, handed = [], []
        hands_over = self.hands_over
        for slot, count in enumerate(counts):
            if count == 0:
                continue  # unused on every rank: like one process, leave .grad as it was
            if hands_over and self._can_hand_over(slot):
                handed.append(slot)
                continue
            copy = self.write_back(slot)
            if copy is not None:
                copies.append(copy)
        if handed:
            for slot in handed:
                self.params[slot].grad = self.views[slot]
            self._hand_over()
        return copies

    def _hand_over(self) -> None:
        """The buffer is the gradients' now. Keep the buffer itself, but none of its views, so
        that :meth:`claim` can tell when they are gone; until then the bucket has no buffer (a
        write into it would fail, not land in a gradient). The copies' sources are views of
        the buffer too: alive until the caller has done the copies."""
        self.spare = self.buffer
        self.buffer = self.grads = self.used_flags = self.tail = self.buffer.new_empty(0)
        self.views = []

    def claim(self) -> None:
        """Before a reduction writes into the buffer: lay one out again if it was handed over,
        in the same memory when no gradient refers to it any more (``zero_grad()`` set them to
        ``None``), else in new memory. Every byte is written before the sum."""
        spare, self.spare = self.spare, None
        if spare is not None:
            self._lay_out(spare if _unshared(spare) else torch.empty_like(spare))

    def _can_hand_over(self, slot: int) -> bool:
        """Whether ``params[slot]`` can take the buffer's view as its ``.grad`` ([Note:
        handing the buffer over])."""
        if not self.plain[slot]:
            return False
        grad = self.params[slot].grad
        if grad is None:
            return True
        return self.fresh[slot] and not grad.requires_grad and grad.is_contiguous()

    def write_back(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Give ``params[slot]`` its reduced gradient; returns ``(destination, source)`` when
        that is a copy, so the caller can batch all copies into one ``_foreach_copy_``."""
        param, view, layout = self.params[slot], self.views[slot], self.layouts[slot]
        grad = param.grad
        if self.as_view:
            param.grad = view if layout is None else layout.wrap(view)
        elif grad is None:  # unused here, used elsewhere: a gradient of its own
            param.grad = view.clone() if layout is None else layout.wrap(view.clone())
        elif layout is not None and not layout.matches(grad):
            param.grad = layout.wrap(view.clone())  # was Partial: see [Note: Partial gradients]
        else:
            return local(grad), view
        return None


def write_results(buckets: Sequence[Bucket], counts: list[list[float]]) -> None:
    """Every bucket's reduced gradients to ``.grad`` (``counts``: the summed used flags, per
    bucket and slot), the copies in one call instead of one per parameter."""
    copies = [c for b, n in zip(buckets, counts, strict=True) for c in b.results(n)]
    if copies:  # unrecorded: [Note: gradients with a graph] in checks/graph_grads.py
        with torch.no_grad():
            torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
