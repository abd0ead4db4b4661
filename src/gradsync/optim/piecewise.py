"""Whether an optimizer steps a piece of a tensor to the same bits as the whole tensor.

[Note: a piece's step, bit for bit]
ZeRO-1 steps each rank's slice of a flat bucket, and a slice cuts parameters where the world
size puts the cut. An elementwise optimizer computes the same value for an element whichever
piece holds it, but *the same bits* need one more thing: that its kernels compute every element
by one formula. torch's CPU kernels run a vectorised body over most of a tensor and a scalar
loop over its last few elements, and where the two round differently (the scalar loop
contracting ``a + b * c`` into one fused multiply-add, the vectorised body not) an element's
bits depend on whether it sits in the body or the tail of *its piece*, that is on N. Measured on
torch 2.13 CPU (AVX512 and AVX2 kernels): in float32 and float64 every optimizer of
``buffers.ELEMENTWISE``, single-tensor or ``foreach``, gives a piece the whole tensor's bits;
the ``fused=True`` kernels of SGD, Adam and AdamW do not, nor, on bfloat16 parameters, do SGD
and RMSprop with momentum and single-tensor ASGD (their scalar tails round another way).

So the deterministic mode checks rather than lists (:func:`piecewise_mismatch`): it steps a
probe tensor whole and cut into pieces of every length up to ``_LONGEST`` (every alignment of a
vector body and tail), with the optimizer class and settings the job asked for, on the
parameters' device and dtype, and compares the bits. It takes tens of milliseconds, once, and it
covers a custom optimizer or another device's kernels as well as torch's CPU ones. It is a
check, not a proof: a difference rarer than the probe's ten thousand elements over three steps
can pass it (the tests check the whole guarantee for AdamW and SGD).
"""

from __future__ import annotations

from typing import Any

import torch

_LONGEST = 70  # piece lengths 1.._LONGEST: every tail of a vector of up to 64 elements
_STEPS = 3  # Adam's moments only enter from the second step


def piecewise_mismatch(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    """``None`` if ``optimizer_class(**defaults)`` stepping a tensor cut into pieces gave every
    element the bits it gets stepping the whole tensor, on a probe in ``dtype`` on ``device``
    ([Note: a piece's step, bit for bit]); else what differed."""
    g = torch.Generator().manual_seed(0)
    lengths = [1 + i % _LONGEST for i in range(4 * _LONGEST)]
    n = sum(lengths)

    def draw() -> torch.Tensor:  # magnitudes over many octaves: a rounding difference shows
        scale = torch.exp2(torch.randint(-8, 8, (n,), generator=g).double())
        return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    start, grads = draw(), [draw() for _ in range(_STEPS)]
    whole, flat = start.clone(), start.clone()
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    pieces = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    try:
        one, cut = optimizer_class([whole], **defaults), optimizer_class(pieces, **defaults)
        with torch.no_grad():
            for grad in grads:
                whole.grad = grad.clone()
                for piece, a, b in zip(pieces, bounds[:-1], bounds[1:], strict=True):
                    piece.grad = grad[a:b].clone()
                one.step()
                cut.step()
    except Exception as exc:  # noqa: BLE001 (said on every rank, named: see the caller)
        return f"stepping a probe raised {type(exc).__name__}: {exc}"
    differ = int((whole != flat).sum())
    if differ == 0:
        return None
    return (
        f"stepping pieces of a {dtype} tensor on {device.type} changed the bits of {differ} "
        f"of {n} elements against stepping it whole"
    )
