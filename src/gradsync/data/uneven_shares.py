"""Uneven shares of a global batch, and the one job they make inexact: ``reduction="mean"``.

When a global batch does not split evenly over the ranks, ranks hold different numbers of
samples, and a mean of per-rank means weighs samples unequally: such a job differs from one
process. ``reduction="item_mean"`` (or ``"sum"`` with a sum-reduced loss) does not. The sampler
is usually built before the wrapper (its length sizes the LR schedule), so it cannot tell at
construction which reduction the job uses; it warns at its first iteration instead, when the
wrapper that reduces this process's gradients exists: if one of gradsync's live wrappers uses
``"mean"``, or if none lives (torch's DDP, which means).
"""

from __future__ import annotations

import warnings

from gradsync.ddp.owners import live_reductions


def warn_if_inexact(uneven: list[int], num_replicas: int) -> list[int]:
    """Warn if global batches of ``uneven`` lengths over ``num_replicas`` ranks make this
    process's job inexact; the lengths left to warn about at a later iteration (none: each
    sampler looks once)."""
    if not uneven:
        return []
    reductions = live_reductions()
    if reductions and "mean" not in reductions:
        return []
    warnings.warn(
        f"global batches of {uneven} samples over num_replicas={num_replicas} give ranks "
        'different numbers of samples: reduction="mean", a mean of per-rank means, then '
        'differs from one process; use reduction="item_mean" (or "sum" with a sum-reduced '
        "loss)",
        stacklevel=3,
    )
    return []
