"""The default setup of ``gradsync verify``: a tiny GPT on a tiny generated corpus.

Small enough that a default run (reference plus 2 spawned ranks) takes seconds on two CPU cores;
the dataset is only ``GLOBAL_BATCH * STEPS_PER_EPOCH`` windows long so that a short run crosses
epoch boundaries, which is where a forgotten ``set_epoch`` shows.

These are also the examples of the factory contracts (see :mod:`gradsync.verify`):
``make_model() -> nn.Module`` and ``make_batch(rank, world_size, step) -> (x, y)``.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.data import DistributedSampler, Subset

from gradsync.testing.corpus import CharDataset, generate_corpus
from gradsync.testing.gpt import GPT, GPTConfig

BLOCK_SIZE = 16
GLOBAL_BATCH = 12
"""Sequences per optimizer step, whatever the world size: divisible by 1, 2, 3, 4 and 6."""
STEPS_PER_EPOCH = 3


@functools.lru_cache(maxsize=1)
def _corpus() -> CharDataset:
    # 60 sentences of ~40 characters: ~140 windows of 17 characters, more than the 36 used.
    return CharDataset(generate_corpus(num_sentences=60, seed=0), BLOCK_SIZE)


def make_model() -> GPT:
    """A 2-layer GPT of ~30k parameters (the runner seeds torch before calling this)."""
    cfg = GPTConfig(
        vocab_size=_corpus().vocab_size, block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32
    )
    return GPT(cfg)


class ShuffledBatches:
    """Rank ``rank``'s shard of global step ``step``, drawn as a training loop draws it.

    A ``DistributedSampler(shuffle=True, seed=0)`` with ``set_epoch(step // steps_per_epoch)``
    permutes the dataset the same way on every rank and deals the permutation out round-robin,
    so the ranks' batches number ``b`` together are positions ``[b * G, (b + 1) * G)`` of the
    permutation (``G`` = global batch): exactly the 1-process batch ``b`` of size ``G``. The
    dataset length is a multiple of ``G``, so no world size pads or drops samples.
    """

    steps_per_epoch = STEPS_PER_EPOCH

    def __call__(self, rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if GLOBAL_BATCH % world_size:
            raise ValueError(
                f"the built-in global batch of {GLOBAL_BATCH} sequences does not split over "
                f"world size {world_size}; use 1, 2, 3, 4, 6 or 12"
            )
        per_rank = GLOBAL_BATCH // world_size
        dataset = Subset(_corpus(), range(GLOBAL_BATCH * STEPS_PER_EPOCH))
        sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0
        )
        sampler.set_epoch(step // STEPS_PER_EPOCH)
        position = step % STEPS_PER_EPOCH
        indices = list(sampler)[position * per_rank : (position + 1) * per_rank]
        xs, ys = zip(*(dataset[i] for i in indices), strict=True)
        return torch.stack(xs), torch.stack(ys)


make_batch = ShuffledBatches()
