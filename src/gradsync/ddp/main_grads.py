"""Mixed precision: low-precision parameters, gradients accumulated and reduced in fp32.

[Note: main gradients]
A model trained in bf16 computes each micro-batch's gradient in bf16; that rounding is the
price of bf16 compute. What it need not pay is a rounding per *addition*: autograd adds every
micro-batch's gradient into ``.grad`` in the parameter's dtype, and an all-reduce in bf16 rounds
every partial sum, so an 8-micro-batch window on 64 ranks rounds each gradient dozens of times,
and small contributions vanish against large ones (bf16 keeps 8 significant bits).

With ``DistributedDataParallel(model, main_grad_dtype=torch.float32)`` the buckets are fp32 and
own the gradients (Megatron-LM's ``main_grad`` buffers, its
``accumulate_allreduce_grads_in_fp32``):

- each parameter's hook adds its gradient, as autograd produced it, into the parameter's slot
  of its fp32 bucket and frees ``.grad``, under ``no_sync()`` too: a window of micro-batches is
  summed in fp32;
- the buckets are reduced in fp32 (or in a wire format, ``compression=``, which still
  accumulates in fp32);
- after the synchronising backward every parameter used on some rank has ``p.main_grad``, its
  reduced gradient in fp32 (a view of the bucket: valid until the next training-mode forward,
  which starts a new window and zeroes the buckets; see [Note: eval forwards keep main
  gradients]), and ``p.grad``, that gradient rounded to the parameter's dtype, for an
  optimizer that steps the low-precision parameters directly;
- :class:`gradsync.optim.MasterWeights` steps fp32 copies of the parameters on ``main_grad``
  and rounds the result back into the model, the usual way to train in bf16.

The result equals one process that accumulates the same per-micro-batch gradients in fp32 (up
to the order of the fp32 additions): ``tests/dist/test_main_grads.py`` checks it, and that
accumulating in bf16 instead is measurably worse.

Not combined (each raises ``UsageError``): ``gradient_as_bucket_view`` (``.grad`` cannot be a
view of a buffer of another dtype), DTensor parameters, and ``shard_optimizer()``. The dtype is
a floating one that torch adds and reduces in (float16, bfloat16, float32, float64) and that
every trainable parameter's dtype promotes to: a narrower one would round each gradient as it
is added, the opposite of the point.

[Note: eval forwards keep main gradients]
The buckets are zeroed when the first grad-enabled forward after a reduction starts a new
window. An eval-mode forward with grad enabled between the backward and the optimizer step
(``model.eval()`` without ``torch.no_grad()``; rank 0 alone, say) starts one too, since its
backward, if one comes, is reduced into the buckets. Zeroing would then leave the step on zero
gradients, or only rank 0's, and the replicas drift apart. So such a forward first moves the
``main_grad`` of the last reduction into a copy, then zeroes the buckets: the step sees the
reduced gradients whether or not a backward follows, on every rank. A training-mode forward
zeroes at once: it is the next window's first micro-batch, whose gradients are on their way
(one run for another purpose, a loss logged without ``torch.no_grad()``, ends ``main_grad``).
(Zeroing lazily, at the window's first gradient, would avoid the copy; only an eval forward
with grad enabled pays it, and ``torch.no_grad()`` avoids it.)

The refusal of a ``.grad`` changed after the reduction (torch's ``clip_grad_norm_`` on
``model.parameters()``) is [Note: clipping main gradients] in ``gradsync/optim/master.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.ddp.buckets import Bucket
from gradsync.errors import UsageError
from gradsync.mesh.dtensors import GradLayout

ACCUMULATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_main_grad_dtype(
    dtype: torch.dtype | None,
    gradient_as_bucket_view: bool,
    layouts: Sequence[GradLayout | None],
    module: nn.Module,
) -> torch.dtype | None:
    """``dtype``, after refusing the combinations [Note: main gradients] lists (naming the
    setting or parameter at fault)."""
    if dtype is None:
        return None
    allowed = ", ".join(str(d) for d in ACCUMULATING_DTYPES)
    if dtype not in ACCUMULATING_DTYPES:
        raise UsageError(
            f"main_grad_dtype must be a floating-point torch.dtype that gradients are "
            f"accumulated in ({allowed}), got {dtype!r}"
        )
    _check_wide_enough(dtype, module)
    if gradient_as_bucket_view:
        raise UsageError(
            "main_grad_dtype and gradient_as_bucket_view=True cannot be combined: .grad has the "
            f"parameter's dtype and cannot be a view of a {dtype} bucket; use p.main_grad"
        )
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    for name, layout in zip(names, layouts, strict=True):
        if layout is not None:
            raise UsageError(
                f"main_grad_dtype does not support DTensor parameters yet (parameter '{name}')"
            )
    return dtype


def _check_wide_enough(dtype: torch.dtype, module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.requires_grad and torch.promote_types(p.dtype, dtype) != dtype:
            raise UsageError(
                f"main_grad_dtype={dtype} is narrower than parameter '{name}' ({p.dtype}): "
                "use a dtype every parameter's dtype promotes to (torch.float32 for a bf16 "
                "or fp16 model)"
            )


def move_main_grads(params: Sequence[nn.Parameter], views: Sequence[torch.Tensor]) -> None:
    """Point every ``p.main_grad`` at its slot in a successor reducer's buckets (``views``, in
    parameter order), keeping its value.

    The reduction writes ``main_grad`` only for parameters used on some rank; one unused
    on every rank keeps the view it had. Left in the retired buckets, which no forward
    zeroes any more, it would hold an old step's gradient for an optimizer to step on,
    where the fixed plan (and one process) gives zeros. (A window an eval forward opened
    is continued instead: ``main_grad`` then holds a copy of the last reduction, not a
    view of the buckets; see [Note: eval forwards keep main gradients].)"""
    for param, view in zip(params, views, strict=True):
        main = getattr(param, "main_grad", None)
        if main is None:
            continue  # never reduced: no main_grad yet, as with the fixed plan
        view.copy_(main)
        param.main_grad = view  # type: ignore[attr-defined]


class AccumulatingBucket(Bucket):
    """A bucket that owns its parameters' gradients (``main_grad_dtype``): each hook adds the
    gradient, as autograd produced it, into the buffer in the buffer's dtype and frees
    ``.grad``, under ``no_sync()`` too; the window's sum is scaled in place before the
    communication, and after it ``p.main_grad`` is a view of the buffer and ``.grad`` that
    gradient rounded to the parameter's dtype. See [Note: main gradients] in ``main_grads.py``
    (no DTensor parameters, no ``gradient_as_bucket_view``: the wrapper refuses both).
    """

    def open_window(self, training: bool) -> None:
        """Zero the buffer for a new accumulation window, after moving the last reduction's
        ``main_grad`` into a copy if the forward is an eval one ([Note: eval forwards keep main
        gradients] in ``main_grads.py``)."""
        if not training:
            self._keep_main_grads()
        self.grads.zero_()

    def _keep_main_grads(self) -> None:
        """Point every ``main_grad`` that is a view of the buffer at a copy of it: one copy of
        the bucket's gradients, not one per parameter."""
        copy = None
        for slot, param in enumerate(self.params):
            if getattr(param, "main_grad", None) is not self.views[slot]:
                continue  # none yet, or already a copy
            if copy is None:
                copy = self.grads.clone()
            offset, view = self.spec.offsets[slot], self.views[slot]
            param.main_grad = copy[offset : offset + view.numel()].view(view.shape)  # type: ignore[attr-defined]

    def arrive(self, slot: int) -> None:
        self._mark_ready(slot)
        self.accumulate(slot)

    def accumulate(self, slot: int) -> None:
        """Add ``params[slot].grad`` to its slot in the buffer's dtype and free it."""
        param = self.params[slot]
        if param.grad is not None:
            self.views[slot].add_(param.grad)
            param.grad = None

    def gather(self, scale: float | None) -> None:
        if scale is not None:  # everything is in the buffer already, unscaled
            self.grads.mul_(scale)

    def _copy_in(
        self, slot: int, scale: float | None, view_grad: bool, zeros: bool = False
    ) -> None:
        if zeros:  # else the slot holds what the window accumulated, scaled in gather
            self.views[slot].zero_()

    def results(self, counts: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        copies = []
        for slot, count in enumerate(counts):
            if count != 0:  # unused on every rank: like one process, leave .grad as it was
                copy = self.write_back(slot)
                if copy is not None:
                    copies.append(copy)
        return copies

    def write_back(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        param, view = self.params[slot], self.views[slot]
        param.main_grad = view  # type: ignore[attr-defined]
        if param.grad is None:
            param.grad = view.to(param.dtype, copy=True)
            return None
        return param.grad, view
