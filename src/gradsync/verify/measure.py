"""What ``gradsync verify`` compares: sample fingerprints, parameter checksums, flat float64
copies of parameters and gradients, and the ratio of two norms."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn


def sample_fingerprints(batch: Sequence[torch.Tensor]) -> list[str]:
    """One digest per sample, over the bytes of its row in every tensor of the batch."""
    n = batch[0].shape[0]
    rows = [t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy() for t in batch]
    out = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=8)
        for r in rows:
            h.update(r[i].tobytes())
        out.append(h.hexdigest())
    return out


def checksum(params: list[nn.Parameter]) -> str:
    """A digest of the exact bytes of every parameter: equal means bitwise-identical replicas."""
    h = hashlib.blake2b(digest_size=6)
    for p in params:
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flat(params: list[nn.Parameter]) -> torch.Tensor:
    # float64: differences of 1e-7 must not drown in the rounding of the comparison itself.
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=torch.float64)
            if p.grad is None
            else p.grad.detach().reshape(-1).double()
            for p in params
        ]
    )


def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    num, den = a.norm().item(), b.norm().item()
    if den == 0.0:
        return 1.0 if num == 0.0 else float("inf")
    return num / den
