"""Classic data-parallel bugs, reproduced on purpose in the N-rank run of ``gradsync verify``.

Each injection changes only the N-rank run (the 1-process reference stays correct), in the way a
user's training script gets it wrong, so that a user can see what the diagnosis of each bug looks
like before meeting it in their own job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BatchFn = Callable[[int, int, int], Sequence[torch.Tensor]]

INJECTIONS: dict[str, str] = {
    "sum-not-mean": "gradients summed over ranks (reduction='sum') while the loss is a mean",
    "same-data": "every rank trains on rank 0's shard (no DistributedSampler)",
    "no-broadcast": "no wrapper, hence no broadcast: each rank keeps its own initial weights "
    "and gradients are synchronised with average_gradients",
    "no-set-epoch": "the sampler's epoch never advances: every epoch repeats the first one's order",
}


def check_injection(
    inject: str | None, world_size: int, reduction: str, steps: int, steps_per_epoch: int | None
) -> None:
    """Raise ``ValueError`` when ``inject`` cannot show its bug with these settings."""
    if inject is None:
        return
    if inject not in INJECTIONS:
        raise ValueError(f"inject must be one of {sorted(INJECTIONS)}, got {inject!r}")
    if world_size < 2:
        raise ValueError(
            f"inject={inject!r} needs world_size >= 2: one rank has no peers to differ"
        )
    if inject == "sum-not-mean" and reduction != "mean":
        raise ValueError("inject='sum-not-mean' needs reduction='mean' (a mean-reduced loss)")
    if inject == "no-set-epoch":
        if steps_per_epoch is None:
            raise ValueError(
                "inject='no-set-epoch' needs steps_per_epoch (--steps-per-epoch, or a "
                "steps_per_epoch attribute on the batch factory)"
            )
        if steps <= steps_per_epoch:
            raise ValueError(
                f"inject='no-set-epoch' needs more steps than one epoch to cross an epoch "
                f"boundary: steps={steps}, steps_per_epoch={steps_per_epoch}"
            )


def ddp_reduction(reduction: str, inject: str | None) -> str:
    """The wrapper's reduction: "sum" under sum-not-mean, whatever the loss is."""
    return "sum" if inject == "sum-not-mean" else reduction


def uses_wrapper(inject: str | None) -> bool:
    """Whether the N-rank run wraps the model in gradsync's DistributedDataParallel.

    Under no-broadcast it does not: the wrapper's construction would broadcast rank 0's weights
    and repair the bug. Gradients are then averaged by ``average_gradients``, which broadcasts
    nothing, so the ranks' different initial weights stay different.
    """
    return inject != "no-broadcast"


def rank_batch(
    batch_fn: BatchFn,
    rank: int,
    world_size: int,
    step: int,
    inject: str | None,
    steps_per_epoch: int | None,
) -> Sequence[torch.Tensor]:
    """The batch rank ``rank`` trains on at ``step``, with a data bug injected if asked."""
    if inject == "same-data":
        return batch_fn(0, world_size, step)
    if inject == "no-set-epoch":
        assert steps_per_epoch is not None  # check_injection ran first
        # The same position in epoch 0: what a sampler whose epoch stays 0 yields.
        return batch_fn(rank, world_size, step % steps_per_epoch)
    return batch_fn(rank, world_size, step)
