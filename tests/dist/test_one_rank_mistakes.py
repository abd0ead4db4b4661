"""A mistake made on one rank only ends in gradsync's error on every rank, naming the rank and
the mistake (real gloo ranks, one spawn of 2): a second ``opt.step()`` of a sharded optimizer
on one rank (a retry after a caught exception) and ``shard_optimizer()`` called on one rank.

Before, the first killed its rank with SIGABRT (its collectives paired with the others' next
forward and gloo aborted on the sizes) while the other reported a lost peer, and the second
read the other rank's first-batch fingerprint as a list of changed parameters."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.testing.spawn import spawn

from toy import outcome

TIMEOUT = 3.0


def new() -> gradsync.DistributedDataParallel:
    torch.manual_seed(0)
    return gradsync.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), timeout=TIMEOUT
    )


def step(model: nn.Module, opt: Any, rank: int, k: int) -> None:
    g = torch.Generator().manual_seed(10 * k + rank)
    opt.zero_grad()
    F.mse_loss(model(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)).backward()
    opt.step()


def extra_step(rank: int) -> str:
    """Rank 1 retries a step that went through, then stops; rank 0 goes on to the next."""
    model = new()
    opt = model.shard_optimizer(torch.optim.SGD, lr=0.1)
    for k in range(3):
        said = outcome(lambda k=k: step(model, opt, rank, k))  # type: ignore[misc]
        if said != "ok":
            return said
        if k == 1 and rank == 1:
            return outcome(opt.step)
    return "no error"


def shard_on_one_rank(rank: int) -> str:
    model = new()
    if rank == 0:
        return outcome(lambda: model.shard_optimizer(torch.optim.SGD, lr=0.1))
    return outcome(lambda: step(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0))


def both_here(name: str, world: int) -> None:
    """Wait until every rank got here, through the store: rank 1 leaves the first case at once
    with its error, rank 0 only after its reduction has timed out and named rank 1, which
    takes seconds on a loaded machine. Without this, rank 1 would wait for rank 0 at the second
    case's construction under the same 3 s deadline, and which of the two ends first would
    decide the test. Not a collective: the group may still hold rank 0's timed-out one."""
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    while store.add(name, 0) < world:
        time.sleep(0.01)


def cases(rank: int, world: int) -> dict[str, str]:
    out = {"extra_step": extra_step(rank)}
    both_here("one_rank_mistakes/second case", world)
    return out | {"shard_on_one_rank": shard_on_one_rank(rank)}


@pytest.fixture(scope="module")
def said() -> list[dict[str, str]]:
    return spawn(cases, 2, timeout_s=60)


def test_a_second_sharded_step_on_one_rank_is_refused_and_named_by_the_others(
    said: list[dict[str, str]],
) -> None:
    mine, theirs = said[1]["extra_step"], said[0]["extra_step"]
    assert mine.startswith("ProtocolError") and "ran again on rank 1" in mine, mine
    assert "no synchronised backward since its step 2" in mine, mine
    # Rank 0 waits for rank 1 at the next reduction and quotes its error.
    assert theirs.startswith("CollectiveTimeoutError"), theirs
    assert "rank 1" in theirs and "ran again on rank 1" in theirs, theirs


def test_shard_optimizer_on_one_rank_is_named_on_every_rank(said: list[dict[str, str]]) -> None:
    for res in said:
        text = res["shard_on_one_rank"]
        assert text.startswith("ProtocolError"), text
        assert "rank 0 at the parameter check of shard_optimizer()" in text, text
        assert "rank 1 at the first-batch check" in text, text
