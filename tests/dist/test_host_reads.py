"""One read from the device per training step, whatever the options (the GPU's sync points).

On CUDA every read of a device value on the host (``tolist``, ``item``, ``float(t)``) waits for
the GPU to finish all it was given, which stalls the pipeline. gradsync reads once per
synchronised step: the readout of used flags, step tags, finite flags and the item total
(``checks/readout.py``). Counted here on CPU as a stand-in for those sync points: with
``check_finite`` (once a read per bucket), ``item_mean`` with counts given as tensors (once a
``float()`` per micro-batch) and a parameter unused on one rank (a bucket filled late), with a
bucket per parameter, steps after the first read exactly once.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import gradsync
from gradsync.testing.spawn import spawn

READS = ("tolist", "item", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def counted_reads() -> Iterator[Counter]:
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any) -> Any:
            counts[name] += 1
            return originals[name](self, *args)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.side = nn.Linear(8, 8)  # used on rank 0 only: filled late on rank 1
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.out(self.side(h) if side else h)


def _reads_per_step(rank: int, world: int) -> list[dict[str, int]]:
    model = gradsync.DistributedDataParallel(
        Net(), bucket_cap_mb=0, find_unused_parameters=True, check_finite=True,
        reduction="item_mean",
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(4):
        with counted_reads() as reads:
            for micro in range(3):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + micro))
                with model.no_sync() if micro < 2 else contextlib.nullcontext():
                    loss = model(x, side=rank == 0).sum()
                    model.count_items(torch.tensor(2))  # as (labels != -100).sum() on a GPU
                    loss.backward()
            opt.step()
            opt.zero_grad()
        per_step.append(dict(reads))
    return per_step


def test_a_step_reads_from_the_device_once() -> None:
    for per_step in spawn(_reads_per_step, 2):
        # The first step also compares the first batches and plans the unused parameters last.
        assert all(reads == {"tolist": 1} for reads in per_step[1:]), per_step
