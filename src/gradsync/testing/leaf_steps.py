"""The accumulation loop of docs/deterministic.md, shared by the deterministic mode's tests.

Each leaf is one micro-batch of the GPT, ``no_sync()`` on all but a step's last; at a step's
end the optimizer steps, until the sampler has counted ``steps`` steps (over all epochs, so a
loop resumed from a checkpoint goes on where it stopped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from gradsync.data import GlobalBatchSampler
from gradsync.testing.gpt import lm_loss


def train_leaf_steps(
    ddp: Any,
    opt: Any,
    sampler: GlobalBatchSampler,
    data: Dataset,
    steps: int,
    reduction: str = "item_mean",
    before_step: Callable[[], Any] | None = None,
) -> list[Any]:
    """Train until ``steps`` steps are done; returns what ``before_step`` (say, a clip) gave
    at each step's end, before the optimizer stepped."""
    loader = DataLoader(data, batch_sampler=sampler)
    done = sampler.epoch * sampler.steps_per_epoch + sampler.step
    out: list[Any] = []
    while done < steps:
        for (x, y), last in sampler.mark_step_ends(loader):
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(x)
                if reduction == "item_mean":
                    ddp.count_items(y.numel())
                per_token = "mean" if reduction == "mean" else "sum"
                lm_loss(logits.float(), y, reduction=per_token).backward()
            if not last:
                continue
            if before_step is not None:
                out.append(before_step())
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                return out
        sampler.set_epoch(sampler.epoch + 1)
    return out
