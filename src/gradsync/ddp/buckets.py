"""Buckets: which gradients travel together (planning, pure) and the flat buffer they share.

Gradients become ready roughly in reverse registration order (the last layer's first), so
buckets are filled in that order: the first bucket to fill is the first to be sent, while
autograd is still computing the rest. One all-reduce per bucket amortises the per-call latency
that one all-reduce per parameter would pay ~100 times per step. (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2.)

Planning (:func:`plan_buckets`) is pure: sizes in, layout out, no process group, so it is
tested on its own. :class:`Bucket` is one planned bucket made real: a flat buffer of gradients
followed by one used flag per parameter (see [Note: used flags] in ``reducer.py``) and, in the
first bucket, every rank's step tag (see [Note: step tags] in ``step_tags.py``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.errors import UsageError
from gradsync.mesh.dtensors import GradLayout, local

MB = 1024 * 1024  # bucket_cap_mb counts MiB, as in torch DDP


@dataclass(frozen=True)
class BucketSpec:
    """The layout of one flat bucket: which parameters, where each one's gradient lives."""

    index: int
    dtype: torch.dtype
    param_indices: tuple[int, ...]  # positions in the wrapper's list of trainable parameters
    offsets: tuple[int, ...]  # element offset of each parameter's gradient in the flat buffer
    numel: int  # elements of gradient in the bucket (excludes the per-parameter used flags)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


# [Note: the default bucket cap]
# torch DDP's 25 MiB suits the models it was tuned on, with hundreds of MiB of gradients or
# more: they get ten buckets or many more. A model with 50 MiB of gradients gets two after the
# 1 MiB first bucket, and the second is ready only halfway through the backward. On a slow
# link the wire idles until then, and the second half's whole transfer comes after the
# backward. Measured on two simulated nodes at 1 Gbit/s with a 12.7M-parameter GPT (50.7 MB):
# 25 MiB 0.95-1.03x torch DDP's step, 5 MiB 0.83-0.86x, while on loopback the two are within
# noise of each other. So the default, "scaled", is an eighth of the model's gradient bytes:
# at least eight buckets, so that the wire waits for about an eighth of the backward before
# the second bucket and about an eighth of the all-reduce is left after it. Bucket sizes stay
# between 1 MiB *on the wire* (below it a collective's fixed cost dominates) and torch's 25 MiB
# (reached at 200 MiB of gradients; larger models get torch's plan). The floor counts wire
# bytes because a compressed bucket pays the fixed costs of its collectives (PowerSGD: two,
# one after the other) for far fewer bytes: bf16 halves the bytes, so its buckets hold at
# least 2 MiB of fp32 gradients; PowerSGD rank 4 sends ~1/80 of them, so its buckets stay at
# 25 MiB (measured on the same GPT: 0.571x torch DDP's step at 25 MiB, 0.614x at 6 MiB on
# the slow link; 1.026x and 1.089x on loopback). Unlike "auto" the rule reads only the
# parameters' sizes and the wire format: the same plan on every rank, in every run of the job
# and in its resume, so the bits a run computes do not depend on timings.
SCALED = "scaled"
SCALED_BUCKETS = 8
SCALED_MIN_MB, SCALED_MAX_MB = 1.0, 25.0
CAP_WORDS = (SCALED, "auto")  # the strings bucket_cap_mb takes (auto: see autotune.py)


def scaled_cap_mb(grad_bytes: int, wire_bytes: int | None = None) -> float:
    """The cap of ``bucket_cap_mb="scaled"`` for ``grad_bytes`` of gradients that take
    ``wire_bytes`` on the wire (default: as many; see [Note: the default bucket cap])."""
    shrink = grad_bytes / wire_bytes if wire_bytes else 1.0  # > 1 for a compressed wire
    floor = SCALED_MIN_MB * max(shrink, 1.0)
    return min(SCALED_MAX_MB, max(floor, grad_bytes / SCALED_BUCKETS / MB))


def check_cap(
    bucket_cap_mb: float | str | None,
    name: str = "bucket_cap_mb",
    words: tuple[str, ...] = CAP_WORDS,
) -> None:
    """``UsageError`` (a ``ValueError``) naming the choices, for a cap ``name`` that is not a
    number >= 0, ``None`` or one of ``words``."""
    if bucket_cap_mb is None or bucket_cap_mb in words:
        return
    number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if number and 0 <= bucket_cap_mb < math.inf:  # type: ignore[operator]
        return
    *others, last = ["a finite number >= 0", "None", *(repr(w) for w in words)]
    choices = f"{', '.join(others)} or {last}"
    raise UsageError(f"{name} must be {choices}, got {bucket_cap_mb!r}")


def resolve_cap(
    bucket_cap_mb: float | str | None,
    params: Sequence[tuple[int, torch.dtype]],
    wire_bytes: int | None = None,
) -> float | None:
    """The cap in MiB a wrapper plans its buckets with, for parameters given as ``(numel,
    dtype)`` whose gradients take ``wire_bytes`` on the wire: "scaled" from those bytes,
    "auto" starts from "scaled" (until it has chosen)."""
    check_cap(bucket_cap_mb)
    if isinstance(bucket_cap_mb, str):
        return scaled_cap_mb(grad_bytes(params), wire_bytes)
    return bucket_cap_mb


def grad_bytes(params: Sequence[tuple[int, torch.dtype]]) -> int:
    """Bytes of the gradients of parameters given as ``(numel, dtype)``."""
    return sum(n * d.itemsize for n, d in params)


def parse_cap(text: str) -> float | str | None:
    """``bucket_cap_mb`` as written on a command line: a number of MiB, ``none`` (one
    bucket), ``scaled`` or ``auto``; for argparse's ``type=``, so a refusal is an
    ``ArgumentTypeError`` whose message argparse prints."""
    word = text.strip().lower()
    if word == "none":
        return None
    if word in CAP_WORDS:
        return word
    try:
        cap = float(word)
    except ValueError:
        cap = math.nan
    if not 0 <= cap < math.inf:
        try:
            check_cap(text)  # refused, naming what was written
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return cap


def cap_to_bytes(bucket_cap_mb: float | None) -> int | None:
    """``bucket_cap_mb`` in bytes; ``None`` means unlimited (one bucket per dtype)."""
    if bucket_cap_mb is None:
        return None
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 or None, got {bucket_cap_mb}")
    return int(bucket_cap_mb * MB)


def plan_buckets(
    params: Sequence[tuple[int, torch.dtype]],
    cap_bytes: int | None,
    first_cap_bytes: int | None = None,
) -> list[BucketSpec]:
    """Group parameters, given as ``(numel, dtype)`` in registration order, into buckets.

    - ``cap_bytes == 0``: every parameter is its own bucket.
    - ``cap_bytes > 0``: walking parameters in reverse registration order, a bucket is closed
      before it would exceed the cap; a parameter larger than the cap gets a bucket of its own.
    - ``cap_bytes is None``: one bucket (per dtype: a flat buffer holds a single dtype).

    ``first_cap_bytes`` (with a positive ``cap_bytes``) closes the first bucket as soon as it
    holds that many bytes (never more than ``cap_bytes``): the last layers' gradients are ready
    first, and a small first bucket starts communication sooner instead of waiting for 25 MB of
    gradients (torch DDP does the same with 1 MB).

    Buckets are numbered in the order they close, which is the order they are launched in.
    """
    specs: list[BucketSpec] = []
    open_: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}

    def close(dtype: torch.dtype) -> None:
        members = open_.pop(dtype)
        open_bytes.pop(dtype)
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i][0]
        specs.append(BucketSpec(len(specs), dtype, tuple(members), tuple(offsets), total))

    for i in reversed(range(len(params))):
        numel, dtype = params[i]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if (
            cap_bytes is not None
            and dtype in open_
            and (cap_bytes == 0 or open_bytes[dtype] + nbytes > cap_bytes)
        ):
            close(dtype)
        open_.setdefault(dtype, []).append(i)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + nbytes
        if cap_bytes and first_cap_bytes is not None and not specs:
            if open_bytes[dtype] >= first_cap_bytes:
                close(dtype)  # the first bucket goes as soon as it holds first_cap_bytes
    for dtype in list(open_):
        close(dtype)
    return specs


class Bucket:
    """One flat buffer of gradients plus a used flag per parameter, and its fill state.

    A DTensor parameter (``layouts[slot]`` is its :class:`~gradsync.mesh.dtensors.GradLayout`)
    occupies the size of its local shard, and gets its reduced gradient back as a DTensor.
    """

    def __init__(
        self,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        num_tags: int = 0,
        layouts: Sequence[GradLayout | None] | None = None,
        padded_numel: int | None = None,
        accumulates: bool = False,
    ) -> None:
        self.spec = spec
        # Hooks add gradients into the buffer and free .grad: [Note: main gradients].
        self.accumulates = accumulates
        self.params = list(params)
        self.layouts = list(layouts) if layouts is not None else [None] * len(self.params)
        device = self.params[0].device
        n_flags = len(params)
        # A reduce-scatter needs equal slices: zeros pad the gradients (``optim/layout.py``).
        n = spec.numel if padded_numel is None else padded_numel
        self.buffer = torch.zeros(n + n_flags + num_tags, dtype=spec.dtype, device=device)
        self.grads = self.buffer[:n]
        self.used_flags = self.buffer[n : n + n_flags]
        self.tags = self.buffer[n + n_flags :]  # see [Note: step tags]
        self.views = [
            self.buffer[off : off + local(p).numel()].view(local(p).shape)
            for off, p in zip(spec.offsets, self.params, strict=True)
        ]
        self.work: Any = None  # the handle of this bucket's communication, once launched
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.arrived: list[int] = []  # slots whose hook fired, not copied in yet (see gather)
        self.filled_late = False  # some slot was filled at the end of backward, not by a hook
        self.work = None

    def arrive(self, slot: int) -> None:
        """``params[slot]``'s hook fired: its gradient is final for this backward. The copy
        into the buffer waits for :meth:`gather`, once the whole bucket has arrived."""
        self.ready[slot] = True
        self.pending -= 1
        if self.accumulates:
            self.accumulate(slot)
        else:
            self.arrived.append(slot)

    def accumulate(self, slot: int) -> None:
        """Add ``params[slot].grad`` to its slot in the buffer's dtype and free it."""
        param = self.params[slot]
        if param.grad is not None:
            self.views[slot].add_(param.grad)
            param.grad = None

    def gather(self, as_view: bool, scale: float | None) -> None:
        """Copy (times ``scale``) every arrived gradient into the buffer: one ``_foreach_copy_``
        and one ``_foreach_mul_`` for the bucket instead of a copy per hook, which is what
        keeps the per-parameter cost of the hook path low (a kernel launch each, on a GPU)."""
        if self.accumulates:  # everything is in the buffer already, unscaled
            if scale is not None:
                self.grads.mul_(scale)
            return
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        in_place: list[torch.Tensor] = []  # .grad already is the view (gradient_as_bucket_view)
        for slot in self.arrived:
            param, view = self.params[slot], self.views[slot]
            grad = param.grad
            if self.layouts[slot] is not None or grad is None:
                self._copy_in(slot, as_view, scale)  # DTensor: see [Note: Partial gradients]
            elif grad.data_ptr() == view.data_ptr():
                in_place.append(view)
            else:
                dst.append(view)
                src.append(grad)
                if as_view:
                    param.grad = view
        self.arrived = []
        if dst and scale is not None and self.buffer.device.type == "cpu":
            # On a CPU the passes over memory cost, not the calls: one multiply into the
            # buffer per gradient reads and writes each element once, where a copy and then a
            # multiply write it twice (the same bits: one rounding of the product either way).
            for d, s in zip(dst, src, strict=True):
                torch.mul(s, scale, out=d)
            dst = []
        if dst:
            torch._foreach_copy_(dst, src)
        if scale is not None and (dst or in_place):
            torch._foreach_mul_(dst + in_place, scale)

    def mark_param_as_ready(
        self, slot: int, as_view: bool, scale: float | None = None, zeros: bool = False
    ) -> None:
        """Put ``params[slot].grad`` times ``scale`` (zeros if it has none, or if ``zeros``)
        into the buffer now: for a slot filled at the end of backward, not by its hook."""
        assert not self.ready[slot], "a parameter was marked ready twice in one backward"
        self._copy_in(slot, as_view, scale, zeros)
        self.ready[slot] = True
        self.pending -= 1

    def _copy_in(self, slot: int, as_view: bool, scale: float | None, zeros: bool = False) -> None:
        # Scaling while copying saves a second pass over the gradient, as torch DDP does with
        # its pre-division.
        param, view, layout = self.params[slot], self.views[slot], self.layouts[slot]
        grad = param.grad
        if self.accumulates:  # the slot holds what the window accumulated; scaled in gather
            if zeros:
                view.zero_()
            return
        if grad is None or zeros:
            view.zero_()
            return
        if layout is not None:
            grad = layout.local_grad(grad)  # see [Note: Partial gradients]
        if grad.data_ptr() != view.data_ptr():
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            if as_view:
                param.grad = view if layout is None else layout.wrap(view)
        elif scale is not None:
            view.mul_(scale)  # .grad already is the view (gradient_as_bucket_view)

    def results(
        self, counts: Sequence[float], as_view: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give every parameter used on some rank (``counts``) its reduced gradient; returns
        the ``(destination, source)`` pairs that are copies, to be done in one batch."""
        copies, fresh = [], []
        for slot, count in enumerate(counts):
            if count == 0:
                continue  # unused on every rank: like one process, leave .grad as it was
            if (
                self.params[slot].grad is None
                and self.layouts[slot] is None
                and not (as_view or self.accumulates)
            ):
                fresh.append(slot)
                continue
            copy = self.write_back(slot, as_view)
            if copy is not None:
                copies.append(copy)
        self._new_grads(fresh)
        return copies

    def _new_grads(self, slots: list[int]) -> None:
        """Give each of ``slots`` (no ``.grad`` yet: after ``zero_grad(set_to_none=True)``,
        i.e. nearly every step) a new gradient. One copy of the span of the buffer they cover,
        each ``.grad`` a view of it, rather than a clone per parameter: on a GPU every clone
        is a kernel launch, and these come after the step's one wait for the device, when
        the device idles until the host queues more work. As with torch DDP's
        ``gradient_as_bucket_view``, the gradients then share one storage (which
        ``torch.save`` of a single gradient would write whole); a span mostly of other slots
        is not copied for a few."""
        if not slots:
            return
        offsets = self.spec.offsets
        lo, hi = offsets[slots[0]], offsets[slots[-1]] + self.views[slots[-1]].numel()
        if len(slots) == 1 or 2 * sum(self.views[s].numel() for s in slots) < hi - lo:
            for slot in slots:
                self.params[slot].grad = self.views[slot].clone()
            return
        span = self.buffer[lo:hi].clone()
        for slot in slots:
            view = self.views[slot]
            start = offsets[slot] - lo
            self.params[slot].grad = span[start : start + view.numel()].view(view.shape)

    def write_back(self, slot: int, as_view: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Give ``params[slot]`` its reduced gradient; returns ``(destination, source)`` when
        that is a copy, so the caller can batch all copies into one ``_foreach_copy_``."""
        param, view, layout = self.params[slot], self.views[slot], self.layouts[slot]
        grad = param.grad
        if self.accumulates:
            param.main_grad = view  # type: ignore[attr-defined]
            if grad is None:
                param.grad = view.to(param.dtype, copy=True)
                return None
            return grad, view
        if as_view:
            param.grad = view if layout is None else layout.wrap(view)
        elif grad is None:  # a DTensor's: a plain one without .grad is given it by _new_grads
            assert layout is not None
            param.grad = layout.wrap(view.clone())
        elif layout is not None and not layout.matches(grad):
            param.grad = layout.wrap(view.clone())  # was Partial: see [Note: Partial gradients]
        else:
            return local(grad), view
        return None
