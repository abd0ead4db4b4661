"""A ``DistributedSampler`` that can resume in the middle of an epoch.

``torch.utils.data.DistributedSampler`` has no state: after a restart it starts its epoch
over, so the samples already trained on are seen twice and the rest of the run differs. This
subclass takes the same arguments, yields the same indices, and adds ``state_dict()`` /
``load_state_dict()``: the epoch and how many of this rank's indices of that epoch the loader
has taken. The next iteration after loading skips those. Its position is a pure function of
(epoch, count), so nothing from DataLoader worker processes is needed; that is why gradsync
does not use ``torchdata``'s ``StatefulDataLoader``, a new dependency whose snapshots of
worker state have had resume bugs that repeat or drop samples.

The count is what the DataLoader drew from the sampler. With ``num_workers=0`` (the default)
that is exactly what the training loop consumed; with worker processes the loader reads
``prefetch_factor * num_workers`` batches ahead, which a resume would skip: there, set
``sampler.position`` to the number of this rank's samples consumed in the epoch before saving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

from gradsync.errors import CheckpointError


class DistributedSampler(torch.utils.data.DistributedSampler):
    """``torch.utils.data.DistributedSampler`` plus ``state_dict`` / ``load_state_dict``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = 0  # this rank's indices of ``self.epoch`` handed out so far
        self._resume_at = 0  # indices to skip at the next iteration (set by load_state_dict)
        self._on_resume: Callable[[], None] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a new epoch starts from its beginning
            self._resume_at = 0
            self.position = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._resume_at = self._resume_at, 0
        on_resume, self._on_resume = self._on_resume, None
        if start and on_resume is not None:
            on_resume()
        self.position = start
        for index in indices[start:]:
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        """Epoch and position, and the settings a resumed sampler must share."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        for key in ("num_replicas", "rank", "seed", "shuffle", "num_samples"):
            if state[key] != mine[key]:
                raise CheckpointError(
                    f"the sampler was saved with {key}={state[key]}, this one has "
                    f"{key}={mine[key]}: the data order would not continue where it stopped"
                )
        super().set_epoch(state["epoch"])
        self.position = self._resume_at = state["position"]

    def call_on_resume(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the first iteration after :meth:`load_state_dict` starts mid-epoch.

        The training checkpoint restores the RNG states through this: a DataLoader draws a
        seed from torch's generator when its iterator is created, before it asks the sampler
        for indices. In the original run that draw happened at the start of the epoch, before
        the checkpoint's RNG state was taken; on resume it would happen after restoring it and
        shift every later dropout mask. Restoring again here, after that draw, continues the
        exact stream.
        """
        self._on_resume = fn
