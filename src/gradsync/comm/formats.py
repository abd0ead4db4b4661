"""Which format a wrapper's buckets travel in: ``DistributedDataParallel(compression=...)``.

| ``compression``  | bytes vs fp32 | the result                                                   |
|------------------|---------------|--------------------------------------------------------------|
| ``None``         | 1             | the exact sum (up to fp32 summation order)                   |
| ``"bf16"``       | 1/2           | within one bf16 rounding of the sum and of each input        |
| ``"fp16"``       | 1/2           | within one fp16 rounding of each, range +-65504              |
| ``PowerSGD(r)``  | ~r(n+m)/(nm)  | a rank-r approximation; error feedback carries the rest      |

Used flags and step tags always travel exactly (see [Note: the bucket communication seam]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm
from gradsync.comm.compress import WIRE_DTYPES, HalfPrecisionHook
from gradsync.comm.hook import AllReduceHook, CommHook
from gradsync.comm.powersgd import PowerSGD, PowerSGDHook
from gradsync.errors import UsageError

Compression = str | PowerSGD | None


def describe_compression(compression: Compression) -> str:
    """A name for ``compression`` (compared across ranks); ``UsageError`` naming the choices
    for anything else."""
    if compression is None:
        return "none"
    if isinstance(compression, PowerSGD):
        return repr(compression)
    if isinstance(compression, str) and compression in WIRE_DTYPES:
        return compression
    raise UsageError(
        f"compression must be None, 'bf16', 'fp16' or a gradsync.comm.PowerSGD(...), "
        f"got {compression!r}"
    )


def describe_compression_state(compression: Compression) -> str | None:
    """What every rank's ``compression`` must hold alike (compared across ranks when a model is
    wrapped): PowerSGD's step count and Q matrices (:meth:`PowerSGD.fingerprint`); ``None``
    for the stateless formats."""
    return compression.fingerprint() if isinstance(compression, PowerSGD) else None


def wire_bytes(
    compression: Compression,
    named_params: Sequence[tuple[str, torch.Tensor]],
    sizes: Sequence[tuple[int, torch.dtype]],
) -> int:
    """Bytes the gradients of ``named_params`` (held in buckets as ``sizes``, ``(numel,
    dtype)``) take in ``compression``, counted once (a ring all-reduce sends ``2(N-1)/N`` of
    them): what the default bucket cap weighs (see [Note: the default bucket cap])."""
    total = 0
    for (_, param), (numel, dtype) in zip(named_params, sizes, strict=True):
        size = dtype.itemsize
        if isinstance(compression, str):  # bf16, fp16: two bytes an element
            size = WIRE_DTYPES[compression].itemsize
        elif isinstance(compression, PowerSGD) and (shape := compression.matrix_shape(param.shape)):
            n, m = shape
            numel = (n + m) * min(n, m, compression.rank)  # the two factors P and Q
        total += numel * size
    return total


def make_comm_hook(
    compression: Compression,
    algorithm: AllReduceAlgorithm,
    group: dist.ProcessGroup | None,
    named_params: Sequence[tuple[str, torch.Tensor]],
    *,
    grad_dtype: torch.dtype | None = None,
    owner: object = None,
    keep_undo: bool = False,
) -> CommHook:
    """The hook for a wrapper's trainable parameters ``named_params`` (in the wrapper's order)
    of the module ``owner``, whose buckets hold gradients in ``grad_dtype`` (``main_grad_dtype``;
    ``None``: each parameter's dtype); ``keep_undo`` (``check_finite``): a stateful hook can
    put back what a refused step changed (``CommHook.discard_step``)."""
    name = describe_compression(compression)
    if compression is None:
        return AllReduceHook(algorithm, group)
    if algorithm.name != "native":
        raise UsageError(
            f"compression={name} runs its own collectives; it needs algorithm='native', "
            f"got {algorithm.name!r}"
        )
    if isinstance(compression, PowerSGD):
        compression.bind(named_params, grad_dtype, owner)
        names = [n for n, _ in named_params]
        return PowerSGDHook(compression, names, group, keep_undo=keep_undo)
    return HalfPrecisionHook(name, group)
