"""FSDP2 with gradsync across, failing fast: layouts, Recovery and the deterministic mode refused
by name, settings that differ across ranks refused on every rank, a rank that never arrives
named within the deadline. One spawn of 4 gloo ranks (replicate2 x shard2) runs every case in
order.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_behaviour import error_text
from torch import nn

from gradsync.data import GlobalBatchSampler
from gradsync.fsdp import replicate_gradients
from gradsync.recovery import Recovery
from gradsync.testing import fsdp_run, mesh_run
from gradsync.testing.fsdp_run import FSDPLayout
from gradsync.testing.gpt import GPTConfig

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
LAYOUT = FSDPLayout(replicate=2, shard=2)
CULPRIT = 3  # the rank that differs or is late
DEADLINE = 2.0


def _model(mesh: Any) -> Any:
    return fsdp_run.make_model(CFG, mesh, torch.float64)


def _refusals(mesh: Any, out: dict) -> None:
    out["not_sharded"] = error_text(lambda: replicate_gradients(nn.Linear(2, 2), mesh["shard"]))
    torch_hsdp = fsdp_run.shard(_model(mesh), mesh["replicate", "shard"])
    out["torch_hsdp"] = error_text(lambda: replicate_gradients(torch_hsdp, mesh["replicate"]))
    sharded = fsdp_run.shard(_model(mesh), mesh["shard"])
    out["shard_axis"] = error_text(lambda: replicate_gradients(sharded, mesh["shard"]))
    opt = torch.optim.AdamW(sharded.parameters())
    sampler = GlobalBatchSampler(range(16), 8)
    out["recovery"] = error_text(lambda: Recovery(sharded, opt, sampler))
    out["deterministic"] = error_text(
        lambda: replicate_gradients(sharded, mesh["replicate"], deterministic=10)
    )
    reduction = "sum" if dist.get_rank() == CULPRIT else "mean"
    out["reduction_differs"] = error_text(
        lambda: replicate_gradients(sharded, mesh["replicate"], reduction=reduction, timeout=20)
    )


def _step(model: Any, sync: Any, mesh: Any, step: int) -> None:
    data = mesh_run.random_batches(CFG, 8, step + 1, seed=5)[step:]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp_run.train(model, sync, opt, data, mesh)


def _faults(rank: int, world: int) -> dict:
    mesh = LAYOUT.build_mesh()
    out: dict = {}
    _refusals(mesh, out)
    dist.barrier()
    model = fsdp_run.make_model(CFG, mesh, torch.float64)
    sync = fsdp_run.parallelize(model, mesh, "mean", timeout=DEADLINE)
    _step(model, sync, mesh, 0)
    if rank == CULPRIT:  # late by 3 deadlines at the second step
        time.sleep(3 * DEADLINE)
    t0 = time.monotonic()
    out["late"] = (error_text(lambda: _step(model, sync, mesh, 1)), time.monotonic() - t0)
    return out


@pytest.fixture(scope="module")
def faults() -> list[dict]:
    from gradsync.testing.spawn import spawn

    return spawn(_faults, LAYOUT.world_size, timeout_s=240, fresh=True)


def _every_rank(faults: list[dict], key: str, error: str, *needles: str) -> None:
    for rank, out in enumerate(faults):
        text = out[key]
        assert text and text.startswith(error), (rank, key, text)
        for needle in needles:
            assert needle in text, (rank, key, needle, text)


@pytest.mark.timeout(300)
def test_layouts_gradsync_cannot_serve_are_refused_by_name(faults: list[dict]) -> None:
    _every_rank(faults, "not_sharded", "UsageError", "fully_shard", "Linear")
    _every_rank(faults, "torch_hsdp", "UsageError", "hybrid sharding", "tok_emb.weight")
    _every_rank(faults, "shard_axis", "UsageError", "shard axis", "['shard']")
    _every_rank(faults, "recovery", "UsageError", "fully_shard (FSDP2)", "newest checkpoint")
    _every_rank(faults, "deterministic", "UsageError", "deterministic=", "shard size")


@pytest.mark.timeout(300)
def test_a_setting_that_differs_on_one_rank_is_refused_on_every_rank(faults: list[dict]) -> None:
    # Rank 0 shares no group with rank 3 (its replicate peer is 2, its shard peer 1), and
    # still raises the same error: the check's two gathers cover every rank.
    _every_rank(
        faults,
        "reduction_differs",
        "ModelMismatchError",
        "'reduction'",
        f"rank {CULPRIT} has 'sum'",
    )


@pytest.mark.timeout(300)
def test_a_rank_that_never_arrives_is_named_within_the_deadline(faults: list[dict]) -> None:
    # Rank 1 all-reduces with rank 3 (replicate peers): it names rank 3, last seen at the
    # first step. Rank 0's peer, rank 2, waits for rank 3 inside FSDP2's own all-gather; rank
    # 0 names rank 2. No rank waits much past the deadline for gradsync's collectives.
    # The deadline counts ranks along gradsync's axis; the message maps them to global ranks.
    for rank, peer in ((1, CULPRIT), (0, 2)):
        text, waited = faults[rank]["late"]
        assert text and text.startswith("CollectiveTimeoutError"), (rank, text)
        assert "rank 1: last seen" in text and "at synchronised backward 1" in text, text
        assert f"1 is global rank {peer}" in text, (rank, text)
        assert waited < DEADLINE + 5, (rank, waited)
    for rank in (2, CULPRIT):  # the late pair fails too, never pairing with stale partners
        assert faults[rank]["late"][0], (rank, faults[rank])
