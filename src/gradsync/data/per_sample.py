"""Random numbers that belong to a sample, not to the rank that happens to load it.

An augmentation that draws from torch's global generator, or from a DataLoader worker's, takes
numbers from a stream that every sample on that rank shares: which sample gets which numbers
depends on which samples the rank holds, in what order, and so on the world size. Seeding a
generator from (seed, epoch, dataset index) instead gives each sample its own numbers wherever
it is loaded, and new ones each epoch.
"""

from __future__ import annotations

import hashlib

import torch


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends only on ``(seed, epoch, index)``.

    A hash rather than a sum, so that nearby triples (``seed + 1`` and ``epoch + 1``, say) do
    not share seeds, and rather than Python's ``hash()``, which is salted per process.
    """
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_generator(
    seed: int, epoch: int, index: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A ``torch.Generator`` seeded with :func:`sample_seed`: pass it as ``generator=`` to the
    random calls of the dataset's ``__getitem__(index)``.

    The dataset needs the epoch: set it on the dataset before the epoch's DataLoader iterator
    is created (worker processes copy the dataset then; ``persistent_workers=True`` keeps the
    first copy, so it needs the epoch some other way, e.g. in the indices it is given).
    """
    g = torch.Generator(device=device)
    g.manual_seed(sample_seed(seed, epoch, index))
    return g
