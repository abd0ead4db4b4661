"""A micro-batch of no sample: what a rank trains on when a short last step leaves it none.

A global batch of fewer samples than ranks (the short last step of an epoch) leaves some ranks
no share. If such a rank skips the step, its loop body does not run there: its
``opt.zero_grad()``, LR scheduler, gradient clipping and checkpoint saves fall out of step with
the other ranks', which ``join()`` cannot repair (it repeats ``optimizer.step()`` alone, see
``ddp/join.py``). So :meth:`GlobalBatchSampler.mark_step_ends` hands such a rank one micro-batch
of no sample for that step, built here from the DataLoader itself: one sample collated as the
loader collates, then cut to zero rows. Every rank then runs the same loop body in every step;
the empty rank's forward and backward add exact zeros to the step's sums, and
``count_items(len(y))`` counts 0 items, so with ``reduction="item_mean"`` (or ``"sum"``) the step
is one process's on the samples that exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor

from gradsync.errors import UsageError


def no_sample_maker(batches: Iterable[Any]) -> Callable[[int], Any]:
    """A function of a dataset index that returns a micro-batch of no sample shaped as
    ``batches`` (a ``DataLoader``) would collate that index; ``UsageError`` if ``batches`` does
    not say how it loads and collates (no ``dataset`` and ``collate_fn``)."""
    dataset = getattr(batches, "dataset", None)
    collate = getattr(batches, "collate_fn", None)
    if dataset is None or not callable(collate):
        raise UsageError(
            "a short last step leaves some rank no sample in this epoch, and mark_step_ends() "
            "then hands that rank an empty micro-batch shaped as the loader's, so that every "
            f"rank runs every step; it needs the DataLoader itself, got {type(batches).__name__} "
            "(or use drop_last=True)"
        )

    def make(index: int) -> Any:
        getitems = getattr(dataset, "__getitems__", None)  # as torch's fetcher loads a batch
        samples = getitems([index]) if callable(getitems) else [dataset[index]]
        return cut_to_no_sample(collate(samples))

    return make


def cut_to_no_sample(batch: Any) -> Any:
    """``batch`` (a collated micro-batch of one or more samples) with every tensor cut to zero
    rows and every list of strings emptied: the same structure, dtypes and trailing shapes."""
    if isinstance(batch, Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        items = {k: cut_to_no_sample(v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(cut_to_no_sample(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (str, bytes)) for v in batch):  # collated strings
            return type(batch)()
        return type(batch)(cut_to_no_sample(v) for v in batch)
    return batch
