"""Global batches: training steps that do not depend on the number of processes.

N processes train the same model as one only if, at every step, the N of them together take
exactly the samples one process would take. torch's ``DistributedSampler`` deals the epoch out
round-robin after padding it to a multiple of N, so which samples make up a step, and which are
seen twice, change with N. :class:`GlobalBatchSampler` fixes the step first and splits it
second:

- the epoch's order is ``randperm`` of a generator seeded with ``seed + epoch`` (as torch's
  sampler draws it), a function of the seed, the epoch and the dataset's length only;
- step ``k`` is the *global batch* ``order[k * G : (k + 1) * G]``;
- rank ``r`` of ``N`` takes a contiguous share of it; shares are as equal as possible (sizes
  differ by at most one, earlier ranks take the extra samples), so the shares concatenated rank
  by rank are the global batch;
- each share is cut into micro-batches of at most ``micro_batch_size`` samples, and every rank
  runs the same number of them, ``ceil(largest share / micro_batch_size)``: a loop that calls
  ``no_sync()`` on all but the last micro-batch of a step then reaches the step's reduction on
  every rank together. A smaller share gets smaller micro-batches, not fewer. Only a share with
  fewer samples than that count (``micro_batch_size=1`` when N does not divide G, or a short
  last global batch) runs one micro-batch per sample; an empty share (a short last global batch
  of fewer than N samples) none, but :meth:`mark_step_ends` gives that rank a micro-batch of no
  sample there (``no_sample.py``): every rank runs every step's loop body, no ``join()`` needed.

With ``reduction="item_mean"``, or ``"sum"`` with a sum-reduced loss, the synchronised gradient
is then that of one process on the global batch, whatever N, the micro-batch size or the
accumulation. ``reduction="mean"`` averages per-rank means, which equals the mean over the
global batch only when every rank holds the same number of samples (``shares_are_equal``; with
accumulation, also only when ``micro_batch_size`` divides the share); when some step's shares
differ, the sampler warns at its first iteration if the job means (``uneven_shares.py``).

With ``deterministic=True`` (the wrapper's deterministic mode, [Note: the fixed leaf tree] in
``comm/tree.py``) the global batch is cut into *leaves* of ``micro_batch_size`` samples first,
``leaves_per_step`` of them, the same at every N; rank ``r`` takes its contiguous block of them
(``gradsync.data.leaf_range``) as its micro-batches, so ranks run different numbers of them when
N does not divide the leaves. A short last global batch has fewer leaves, the first ones.

Randomness drawn per rank does not follow the samples: a rank's generator stream (dropout in the
model, an augmentation drawing from torch's global generator, DataLoader worker seeds) is
consumed by whatever samples land on that rank, and that changes with N. Data-side randomness
can follow each sample with :func:`gradsync.data.sample_generator`; a model with dropout trains
the same distribution at every N, not the same numbers.

The position is counted in global steps: ``step`` advances when the last micro-batch of a step
is handed out, so after the step's ``opt.step()`` it is the number of steps completed in the
epoch. ``state_dict()`` holds the epoch, that count and the settings that define the global
batches, nothing about N or the rank, so a sampler built for any world size continues at the
next global step. With DataLoader worker processes the loader draws ``prefetch_factor *
num_workers`` micro-batches ahead of training and the count runs ahead with it: keep
``num_workers=0``, or set ``sampler.step`` to the steps the loop completed before saving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils.data

from gradsync.comm.tree import leaf_range
from gradsync.data.no_sample import no_sample_maker
from gradsync.data.uneven_shares import warn_if_inexact
from gradsync.errors import CheckpointError, UsageError

T = TypeVar("T")

# What defines the epoch's global batches: a saved position means nothing under other values.
_SETTINGS = ("seed", "shuffle", "dataset_length", "global_batch_size", "drop_last")


def _split(length: int, parts: int, part: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``part`` when ``range(length)`` is cut into ``parts``
    contiguous pieces whose sizes differ by at most one, the longer ones first."""
    base, extra = divmod(length, parts)
    start = part * base + min(part, extra)
    return start, start + base + int(part < extra)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")
    return value


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: the given values, or the process group's, as torch's sampler."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "num_replicas= and rank= are needed when no process group is initialised"
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    _positive("num_replicas", num_replicas)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise UsageError(f"rank={rank!r} is not in [0, num_replicas={num_replicas})")
    return num_replicas, rank


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's micro-batches of every global batch, as lists of dataset indices, in step
    order: the ``batch_sampler=`` of a ``DataLoader``.

    Args:
        dataset: anything with ``len()``; only its length is used.
        global_batch_size: samples per training step over all ranks; at least ``num_replicas``,
            so that every rank has a share of every full step.
        micro_batch_size: at most this many samples per micro-batch; ``None``: one micro-batch
            per rank and step (no accumulation).
        num_replicas, rank: as torch's ``DistributedSampler``; by default the process group's.
        shuffle, seed: the epoch's order is ``randperm`` seeded with ``seed + epoch``, or
            ``range(len(dataset))`` without shuffle.
        drop_last: drop the epoch's last global batch if it is short; otherwise it is a shorter
            step, split the same way.

    Nothing is padded: torch's sampler repeats samples to give every rank as many; here every
    sample of the epoch is used exactly once (except a dropped last global batch).
    """

    # The position is the same on every rank and means the same at any world size: a training
    # checkpoint may load rank 0's into every rank of another world size.
    world_size_independent = True

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        if deterministic and micro_batch_size is None:
            raise UsageError(
                "GlobalBatchSampler(deterministic=True) needs micro_batch_size: the size of a "
                "leaf, the same at every world size"
            )
        self.deterministic = deterministic
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        if global_batch_size < self.num_replicas:
            raise UsageError(
                f"global_batch_size={global_batch_size} is smaller than "
                f"num_replicas={self.num_replicas}: every rank needs a share of every step"
            )
        largest_share = -(-global_batch_size // self.num_replicas)
        self._whole_shares = micro_batch_size is None  # one micro-batch per rank at any N
        self.micro_batch_size = (
            largest_share
            if micro_batch_size is None
            else _positive("micro_batch_size", micro_batch_size)
        )
        self.dataset_length = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"a dataset of {self.dataset_length} samples has no global batch of "
                f"global_batch_size={global_batch_size} with drop_last={drop_last}"
            )
        if deterministic:
            self._check_leaves(self.num_replicas)
        self.epoch = 0
        self.step = 0  # global steps of ``self.epoch`` whose micro-batches were all handed out
        self._resume_at = 0  # the step the next iteration starts at (set by load_state_dict)
        self._on_resume: Callable[[], None] | None = None
        self._uneven = self._uneven_lengths()  # warned about at the first iteration, if inexact

    @property
    def leaves_per_step(self) -> int:
        """The leaves of a full step with ``deterministic=True``: ``ceil(global_batch_size /
        micro_batch_size)``, the same at every world size; pass it to the wrapper's
        ``deterministic=``."""
        return -(-self.global_batch_size // self.micro_batch_size)

    def _check_leaves(self, num_replicas: int) -> None:
        if self.leaves_per_step < num_replicas:
            raise UsageError(
                f"deterministic=True: {self.leaves_per_step} leaves per step (global_batch_size="
                f"{self.global_batch_size}, micro_batch_size={self.micro_batch_size}) cannot give "
                f"each of num_replicas={num_replicas} ranks one; use smaller micro-batches"
            )

    def _my_leaves(self, length: int) -> range:
        """This rank's leaves of a global batch of ``length`` samples (``deterministic``): its
        block of a full step's leaves, cut at the batch's last leaf."""
        block = leaf_range(self.leaves_per_step, self.num_replicas, self.rank)
        present = -(-length // self.micro_batch_size)
        return range(block.start, max(block.start, min(block.stop, present)))

    def _uneven_lengths(self) -> list[int]:
        """The lengths of global batches that give ranks different numbers of samples, for
        ``uneven_shares.py`` (none counted in the deterministic mode: ``"mean"`` averages
        leaves there, see gradsync/ddp/deterministic.py)."""
        if self.deterministic:
            return []
        lengths = {self._batch_length(0), self._batch_length(self.steps_per_epoch - 1)}
        return sorted(n for n in lengths if n % self.num_replicas)

    # -- the epoch's layout: pure functions of the settings ---------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Global steps in an epoch (the same at every world size)."""
        full, rest = divmod(self.dataset_length, self.global_batch_size)
        return full + int(rest > 0 and not self.drop_last)

    def _batch_length(self, step: int) -> int:
        return min(self.global_batch_size, self.dataset_length - step * self.global_batch_size)

    def _checked_length(self, step: int) -> int:
        if not 0 <= step < self.steps_per_epoch:
            raise UsageError(f"step={step} is not in [0, steps_per_epoch={self.steps_per_epoch})")
        return self._batch_length(step)

    def _micro_count(self, length: int) -> int:
        """This rank's micro-batches for a global batch of ``length`` samples."""
        if self.deterministic:
            return len(self._my_leaves(length))
        start, stop = _split(length, self.num_replicas, self.rank)
        largest_share = -(-length // self.num_replicas)
        return min(-(-largest_share // self.micro_batch_size), stop - start)

    @property
    def micro_batches_per_step(self) -> int:
        """This rank's micro-batches in a full global batch: the gradient accumulation steps.
        The same on every rank unless ``micro_batch_size=1`` and N does not divide G."""
        return self._micro_count(self.global_batch_size)

    def micro_batches_in_step(self, step: int) -> int:
        """This rank's micro-batches in global step ``step`` of the epoch: fewer than
        :attr:`micro_batches_per_step` only in a short last step."""
        return self._micro_count(self._checked_length(step))

    def shares_are_equal(self, step: int) -> bool:
        """Whether every rank holds as many samples in ``step``: only then is
        ``reduction="mean"`` the mean over the global batch."""
        return self._checked_length(step) % self.num_replicas == 0

    def global_order(self) -> list[int]:
        """The dataset indices of this epoch's global batches, concatenated in step order."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_length, generator=g).tolist()
        else:
            order = list(range(self.dataset_length))
        return order[: self.steps_per_epoch * self.global_batch_size]

    def _micro_batches(self, order: list[int], step: int) -> list[list[int]]:
        length = self._batch_length(step)
        if self.deterministic:  # leaf i: samples [i m, (i + 1) m) of the global batch
            first, m = step * self.global_batch_size, self.micro_batch_size
            return [
                order[first + i * m : first + min((i + 1) * m, length)]
                for i in self._my_leaves(length)
            ]
        start, stop = _split(length, self.num_replicas, self.rank)
        first = step * self.global_batch_size
        share = order[first + start : first + stop]
        count = self._micro_count(length)
        pieces = (_split(len(share), count, i) for i in range(count))
        return [share[a:b] for a, b in pieces]

    def micro_batches_of(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global step ``step`` of the current epoch (what
        iterating hands out for that step), without moving the position."""
        self._checked_length(step)
        self._uneven = warn_if_inexact(self._uneven, self.num_replicas)
        return self._micro_batches(self.global_order(), step)

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Split the same global batches over ``num_replicas`` ranks from now on, this one
        being ``rank``: the position and every step's samples stay; only the shares change
        (after a membership change, see ``gradsync.recovery``)."""
        num_replicas, rank = _replicas(num_replicas, rank)
        if self.global_batch_size < num_replicas:
            raise UsageError(
                f"global_batch_size={self.global_batch_size} is smaller than "
                f"num_replicas={num_replicas}: every rank needs a share of every step"
            )
        if self.deterministic:
            self._check_leaves(num_replicas)
        elif self._whole_shares:  # no accumulation asked for: none at the new size either
            self.micro_batch_size = -(-self.global_batch_size // num_replicas)
        self.num_replicas, self.rank = num_replicas, rank

    def __len__(self) -> int:
        """This rank's micro-batches in a whole epoch (also after a resume, as torch's)."""
        full, rest = divmod(self.dataset_length, self.global_batch_size)
        short = self._micro_count(rest) if rest and not self.drop_last else 0
        return full * self.micro_batches_per_step + short

    # -- iteration and position -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``, as torch's sampler; a new epoch starts at its first step."""
        if epoch != self.epoch:
            self._resume_at = 0
            self.step = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        self._uneven = warn_if_inexact(self._uneven, self.num_replicas)
        order = self.global_order()
        start, self._resume_at = self._resume_at, 0
        on_resume, self._on_resume = self._on_resume, None
        if start and on_resume is not None:
            on_resume()
        self.step = start
        for step in range(start, self.steps_per_epoch):
            batches = self._micro_batches(order, step)
            if not batches:  # an empty share of a short last step: nothing to hand out
                self.step = step + 1
            for i, batch in enumerate(batches):
                if i == len(batches) - 1:
                    self.step = step + 1
                yield batch

    def mark_step_ends(self, batches: Iterable[T]) -> Iterator[tuple[T, bool]]:
        """Each item of ``batches`` (the DataLoader over this sampler) with whether it is the
        last micro-batch of its global step: ``for (x, y), last in sampler.mark_step_ends(loader)``.

        The pairing follows from the sampler's sizes, not from what it has handed out, so it
        holds with worker processes reading ahead. Pass the loader, not an iterator already
        started: the step it starts at (the resumed one after :meth:`load_state_dict`) is read
        before the loader's first draw.

        Every rank gets an item marked last in every global step: a rank whose share of a short
        last step is empty gets a micro-batch of no sample, built from the loader's ``dataset``
        and ``collate_fn`` (``no_sample.py``). Not with ``deterministic=True``: a micro-batch is
        a leaf there, and a rank past the step's last leaf runs none (wrap the epoch in
        ``model.join(opt)``; [Note: leaves and join]).
        """
        start = self._resume_at
        short = self._batch_length(self.steps_per_epoch - 1)
        empty = None  # whether some rank has an empty share is the same on every rank
        if short < self.num_replicas and not self.deterministic:
            empty = no_sample_maker(batches)
        items = iter(batches)
        for step in range(start, self.steps_per_epoch):
            count = self._micro_count(self._batch_length(step))
            if count == 0 and empty is not None:  # an empty share: a step of no sample
                self.step = step + 1
                yield empty(self.global_order()[step * self.global_batch_size]), True
            # range first: zip stops at the step's count without drawing the next item
            for i, item in zip(range(count), items, strict=False):
                yield item, i == count - 1

    def state_dict(self) -> dict[str, int]:
        """The epoch, the global steps completed in it, and the settings that define the global
        batches (and, with ``deterministic``, the leaves): nothing that depends on the world
        size or the rank."""
        leaves = {"leaf_size": self.micro_batch_size} if self.deterministic else {}
        return {
            **leaves,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "dataset_length": self.dataset_length,
            "global_batch_size": self.global_batch_size,
            "drop_last": int(self.drop_last),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the next global step of the saved epoch, at any world size or rank."""
        mine = self.state_dict()
        for key in mine:
            if key not in state:
                raise CheckpointError(
                    f"the sampler state has no {key!r}: it is not a GlobalBatchSampler's"
                )
        for key in (*_SETTINGS, "leaf_size"):
            if key in mine and state[key] != mine[key]:
                raise CheckpointError(
                    f"the sampler was saved with {key}={state[key]}, this one has "
                    f"{key}={mine[key]}: the global batches would not be the same"
                )
        if not 0 <= state["step"] <= self.steps_per_epoch:
            raise CheckpointError(
                f"the sampler state's step={state['step']} is not in "
                f"[0, steps_per_epoch={self.steps_per_epoch}]"
            )
        self.epoch = state["epoch"]
        self.step = self._resume_at = state["step"]

    def call_on_resume(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the first iteration after :meth:`load_state_dict` starts mid-epoch;
        the training checkpoint restores RNG states through it, as with
        :meth:`gradsync.data.DistributedSampler.call_on_resume`."""
        self._on_resume = fn
