"""A step's share: this rank's micro-batches of a global step, as :meth:`Step.micro_batches
<gradsync.recovery.Step.micro_batches>` hands them out.

A short last global batch of fewer samples than ranks leaves some ranks no share. Such a rank
must still run the step's body: skipping it would skip its forward and backward, so its next
step's collectives would meet the others' collectives of this one, and nothing in the
backend tells them apart. So it gets one micro-batch of no sample (``data/no_sample.py``, as
``GlobalBatchSampler.mark_step_ends`` gives it without ``Recovery``): its forward and backward
add exact zeros and ``count_items(0)``, and the step is one process's on the samples that
exist. The step tags then check that every rank runs the same step ([Note: step tags] in
``ddp/checks/tags.py``).

In the deterministic mode a micro-batch is a leaf of the fixed tree, and a leaf of no sample
would be a leaf that one process never has: a step that leaves some rank no leaf is refused on
every rank, before any collective, naming the step and the way out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gradsync.comm.tree import leaf_range
from gradsync.data import GlobalBatchSampler
from gradsync.data.no_sample import no_sample_maker
from gradsync.errors import UsageError


def step_length(sampler: GlobalBatchSampler, index: int) -> int:
    """Samples in global step ``index`` of the epoch (fewer than a global batch in a short last
    step)."""
    size = sampler.global_batch_size
    return min(size, sampler.dataset_length - index * size)


def refuse_leafless_step(sampler: GlobalBatchSampler, index: int, number: int) -> None:
    """Raise on every rank (the sizes are the same everywhere) if, in the deterministic mode,
    step ``index`` of the epoch leaves some rank without a leaf."""
    if not sampler.deterministic:
        return
    length = step_length(sampler, index)
    present = -(-length // sampler.micro_batch_size)
    ranks = sampler.num_replicas
    if leaf_range(sampler.leaves_per_step, ranks, ranks - 1).start >= present:
        raise UsageError(
            f"step {number} (global step {index} of epoch {sampler.epoch}, {length} samples) "
            f"has {present} leaves of micro_batch_size={sampler.micro_batch_size} for "
            f"{ranks} ranks: in the deterministic mode a rank without a leaf cannot take part in "
            "a step under Recovery; pass drop_last=True to the GlobalBatchSampler, or choose a "
            "dataset length whose last step has a leaf for every rank"
        )


def micro_batches(
    sampler: GlobalBatchSampler, index: int, loader: torch.utils.data.DataLoader
) -> Iterator[Any]:
    """This rank's micro-batches of global step ``index`` of the sampler's epoch, read from
    ``loader``'s dataset and collated with its ``collate_fn``; one micro-batch of no sample
    where this rank's share is empty."""
    collate = loader.collate_fn
    shares = sampler.micro_batches_of(index)
    if not shares and not sampler.deterministic:
        first = sampler.global_order()[index * sampler.global_batch_size]
        yield no_sample_maker(loader)(first)
        return
    for indices in shares:
        yield collate([loader.dataset[i] for i in indices])
