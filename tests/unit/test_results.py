"""With one rank the step checks read nothing from the device, and see what a read would give.

One gloo process group of world size 1 in this process (no spawn). Every reduction's results
are computed both ways, from the host (what the wrapper uses) and from the device buffers (what
it would read), and must be equal; the cases cover what the flags and tags carry: parameters
unused in some steps, accumulation under ``no_sync``, a parameter set changed after wrapping.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp import reducer as reducer_module
from gradsync.ddp.checks import readout as results
from gradsync.ddp.checks.tags import RIDER
from gradsync.errors import ParametersChangedError, UnusedParametersError
from gradsync.timing import slots


@pytest.fixture()
def compared(monkeypatch) -> list[tuple[bool, results.StepReadout]]:  # type: ignore[no-untyped-def]
    """Each reduction's (read from the device?, results), after checking both ways agree."""
    seen: list[tuple[bool, results.StepReadout]] = []
    reads: list[int] = []
    real_read = results._read

    def counted_read(*args):  # type: ignore[no-untyped-def]
        reads.append(1)
        return real_read(*args)

    def both(buckets, check_finite, reduction, world_size, used, tail):  # type: ignore[no-untyped-def]
        before = len(reads)
        got = results.read_step(buckets, check_finite, reduction, world_size, used, tail)
        from_device = len(reads) > before
        flat = real_read(buckets, check_finite, reduction)
        read = results._parse(flat, buckets, check_finite, reduction, world_size, tail)
        # The step timeline's milliseconds went through the bucket's dtype on the device.
        riders = [dict(r.riders) for r in (got, read)]
        timings = [r.pop(slots.RIDER, []) for r in riders]
        assert timings[0] == pytest.approx(timings[1], rel=1e-6)
        assert got._replace(riders=riders[0]) == read._replace(riders=riders[1])
        seen.append((from_device, got))
        return got

    monkeypatch.setattr(results, "_read", counted_read)
    monkeypatch.setattr(reducer_module, "read_step", both)
    return seen


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.body(x))).sum()


def step(model: nn.Module, head: str = "a") -> None:
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 4), head).backward()


def test_one_rank_reads_no_device_values_and_sees_the_same(one_rank, compared) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(
        TwoHeads(), bucket_cap_mb=0, find_unused_parameters=True
    )
    step(model, "a")
    step(model, "b")  # head a unused: its flags are 0
    with model.no_sync():
        step(model, "a")
    model(torch.ones(2, 4), "b").backward()  # the window used both heads
    assert len(compared) == 3
    assert not any(from_device for from_device, _ in compared)
    counts = [c for _, (per_bucket, *_) in compared for c in per_bucket]
    assert [0.0] in counts and [1.0] in counts  # both kinds of flag were compared
    tags = [readout.riders[RIDER] for _, readout in compared]
    assert [t[0].steps for t in tags] == [0, 1, 2] and tags[2][0].forwards == 2

    # What needs device values still reads them.
    checked = gradsync.DistributedDataParallel(
        TwoHeads(), check_finite=True, find_unused_parameters=True
    )
    step(checked)
    assert compared[-1][0]


def test_one_rank_errors_are_the_same(one_rank, compared) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(TwoHeads(), bucket_cap_mb=0)
    with pytest.raises(UnusedParametersError, match="a.weight"):
        step(model, "b")
    model = gradsync.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    step(model)
    model.module.a.weight.requires_grad_(False)  # the parameter set changed after wrapping
    with pytest.raises(ParametersChangedError, match="a.weight"):
        step(model)
    assert len(compared) == 3 and not any(from_device for from_device, _ in compared)


def test_a_world_of_one_issues_no_all_reduce_and_keeps_its_gradients(one_rank, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A sum over one rank is the tensor itself: the native all-reduce issues nothing.
    calls = []
    real = torch.distributed.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", counted)
    torch.manual_seed(0)
    plain = TwoHeads()
    model = gradsync.DistributedDataParallel(copy.deepcopy(plain), find_unused_parameters=True)
    before = len(calls)
    step(model, "a")
    step(plain, "a")
    assert len(calls) == before  # no collective for the gradients
    for p, q in zip(model.module.parameters(), plain.parameters(), strict=True):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad)
