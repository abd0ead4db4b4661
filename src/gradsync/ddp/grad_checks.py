"""The checks run on every reduced step: parameters without gradients and NaN/Inf gradients.

Both decide from data every rank holds identically after the bucket sums (the used flags and
the finite flags travel inside the buckets), so every rank reaches the same verdict and the
same error. Only then, to name *who* held what, do the ranks exchange their local lists in
one gather: every rank is known to reach it, so it cannot hang.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from gradsync.errors import NonFiniteGradientError, UnusedParametersError


def _per_rank_lines(mine: list[str], group: dist.ProcessGroup | None) -> str:
    per_rank: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, mine, group=group)
    return "\n".join(f"  rank {r}: {names}" for r, names in enumerate(per_rank) if names)


def raise_if_unused(
    missing: Sequence[str],
    unused_here: list[str],
    rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Raise :class:`UnusedParametersError` on every rank if ``missing`` (the parameters used
    on fewer ranks than contributed, the same list on every rank) is not empty."""
    if not missing:
        return
    raise UnusedParametersError(
        "these parameters received no gradient in this backward pass "
        f"(find_unused_parameters=False), seen from rank {rank}:\n"
        + _per_rank_lines(unused_here, group)
        + "\nMake every parameter take part in the loss on every rank, freeze the ones you do "
        "not train (requires_grad=False), or pass find_unused_parameters=True to count a "
        "missing gradient as zero."
    )


def raise_nonfinite(
    bad_buckets: list[int],
    nonfinite_here: list[str],
    rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Raise :class:`NonFiniteGradientError` on every rank; NaN/Inf survive the sum, so every
    rank sees the same ``bad_buckets`` and arrives here."""
    raise NonFiniteGradientError(
        f"NaN/Inf gradients in bucket(s) {bad_buckets} (seen from rank {rank}); "
        "before communication they were in:\n"
        + _per_rank_lines(nonfinite_here, group)
        + "\nParameters are unchanged. Every rank raised this error, so catching it on every "
        "rank and calling optimizer.zero_grad() skips the step consistently."
    )
