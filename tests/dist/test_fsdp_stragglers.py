"""The straggler timeline of ``replicate_gradients``: on replicate2 x shard2 (4 gloo ranks), a
rank that sleeps 50 ms in its forward, in its backward, or before each of its two micro-batches
(the first under ``set_requires_gradient_sync(False)``), is named with that phase in the first
report (step 10), and not its shard peer, which waited for it in FSDP2's all-gathers and
reduce-scatters ([Note: FSDP2's waits] in ``gradsync/fsdp/timeline.py``); every rank holds
the same report and rank 0 says it in one line. A balanced run of 30 steps names nobody;
``straggler_every=0`` measures nothing. One spawn for all cases.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from gradsync.fsdp import replicate_gradients
from gradsync.testing import fsdp_run
from gradsync.testing.fsdp_run import FSDPLayout
from gradsync.testing.gpt import GPTConfig, lm_loss
from gradsync.testing.log_lines import LogLines
from gradsync.testing.mesh_run import random_batches
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
LAYOUT = FSDPLayout(replicate=2, shard=2)
SLOW_RANK, SLEEP = 1, 0.05  # rank 1's shard peer is rank 0, its replica ranks 2 and 3
MICRO = {"forward": 1, "backward": 1, "data": 2, "none": 1}  # micro-batches per step (all but
# the last no-sync)


def _train(rank: int, mesh: Any, where: str, steps: int, every: int = 10) -> dict[str, Any]:
    model = fsdp_run.make_model(CFG, mesh, torch.float32)
    sharded = fsdp_run.shard(model, mesh["shard"])
    sync = replicate_gradients(
        model, fsdp_run.gradsync_mesh(mesh), timeout=30, straggler_every=every
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    slow = rank == SLOW_RANK
    if slow and where == "forward":  # after FSDP2's all-gather of the block: its own work
        model.blocks[0].register_forward_pre_hook(lambda *a: time.sleep(SLEEP))
    if slow and where == "backward":  # between the two blocks' backward: its shard peer waits
        # for it in block 1's reduce-scatter or block 0's all-gather, inside its own backward
        def sleep_in_backward(module: Any, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: time.sleep(SLEEP))

        model.blocks[1].register_forward_hook(sleep_in_backward)
    handler = LogLines(logging.INFO)
    logger = logging.getLogger("gradsync.stragglers")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    reports = []
    batches = random_batches(CFG, 8, steps, seed=rank)
    try:
        for step, batch in enumerate(batches):
            x, y = fsdp_run.rank_part(batch, mesh)
            micro = MICRO[where]
            for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                if slow and where == "data":
                    time.sleep(SLEEP)
                sharded.set_requires_gradient_sync(m == micro - 1)
                lm_loss(model(xm), ym).backward()
            opt.step()
            opt.zero_grad()
            if every and (step + 1) % every == 0:
                reports.append(sync.timeline.last_report)
    finally:
        logger.removeHandler(handler)
    return {"reports": reports, "lines": handler.lines, "metrics": sync.timeline.metrics()}


def _cases(rank: int, world: int) -> dict[str, Any]:
    mesh = LAYOUT.build_mesh()
    out = {where: _train(rank, mesh, where, 10) for where in ("forward", "backward", "data")}
    out["balanced"] = _train(rank, mesh, "none", 30)
    out["off"] = _train(rank, mesh, "forward", 5, every=0)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return spawn(_cases, LAYOUT.world_size, timeout_s=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["forward", "backward", "data"])
def test_the_slow_rank_is_named_with_its_phase_not_its_shard_peer(
    cases: list[dict[str, Any]], where: str
) -> None:
    first = cases[0][where]["reports"][0]  # the report at step 10
    assert first["num_steps"] == 8, first
    named = [(s["rank"], s["phase"]) for s in first["stragglers"]]
    assert named == [(SLOW_RANK, where)], first
    late, per_step = first["stragglers"][0]["late_ms"], SLEEP * 1e3 * MICRO[where]
    assert 0.7 * per_step < late < 2.0 * per_step, first
    assert not first["stalls"], first
    lines = [line for line in cases[0][where]["lines"] if "arrived late" in line]
    assert len(lines) == 1 and f"rank {SLOW_RANK} arrived late" in lines[0], lines
    assert not any(c[where]["lines"] for c in cases[1:])
    assert all(c[where]["reports"][0]["stragglers"] == first["stragglers"] for c in cases)


@pytest.mark.timeout(240)
def test_a_balanced_run_names_nobody(cases: list[dict[str, Any]]) -> None:
    reports = cases[0]["balanced"]["reports"]
    assert len(reports) == 3
    assert all(r["stragglers"] == [] and r["stalls"] == [] for r in reports), reports
    assert not [line for line in cases[0]["balanced"]["lines"] if "late in" in line]
    metrics = cases[0]["balanced"]["metrics"]
    assert metrics["gradsync/num_steps"] == 10.0 and metrics["gradsync/stragglers"] == 0.0
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.timeout(240)
def test_straggler_every_0_measures_nothing(cases: list[dict[str, Any]]) -> None:
    for c in cases:
        assert c["off"]["metrics"] == {"gradsync/num_steps": 0.0}
        assert not c["off"]["lines"]
