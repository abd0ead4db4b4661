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
  reduced gradient in fp32 (a view of the bucket: valid until the next forward that starts a
  new window, which zeroes the buckets), and ``p.grad``, that gradient rounded to the
  parameter's dtype, for an optimizer that steps the low-precision parameters directly;
- :class:`gradsync.optim.MasterWeights` steps fp32 copies of the parameters on ``main_grad``
  and rounds the result back into the model, the usual way to train in bf16.

The result equals one process that accumulates the same per-micro-batch gradients in fp32 (up
to the order of the fp32 additions): ``tests/dist/test_main_grads.py`` checks it, and that
accumulating in bf16 instead is measurably worse.

Not combined (each raises ``UsageError``): ``gradient_as_bucket_view`` (``.grad`` cannot be a
view of a buffer of another dtype), DTensor parameters, and ``shard_optimizer()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.errors import UsageError
from gradsync.mesh.dtensors import GradLayout


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
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"main_grad_dtype must be a floating-point torch.dtype, got {dtype!r}")
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
