"""FSDP2 inside, gradsync across: a ``fully_shard``-ed GPT whose gradients gradsync also reduces
over the replicate or context-parallel axis equals one process on the global batch.

Each layout is one spawn of 4 gloo ranks running a grid of cases (the reductions, no-sync
accumulation, torch's own hybrid sharding beside gradsync's); a missing rank is one more spawn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync.fsdp import ReplicatedGradients
from gradsync.testing import fsdp_run, mesh_run
from gradsync.testing.fsdp_run import FSDPLayout
from gradsync.testing.gpt import GPTConfig
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
BATCH, STEPS = 8, 3
DTYPE = torch.float64  # a sync bug shows as ~1e-3, rounding as ~1e-16
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "sgd_sum": lambda ps: torch.optim.SGD(ps, lr=0.1 / 64, momentum=0.9),
}
# (optimizer, reduction, micro-batches per step, gradients set to None between steps). With
# gradients zeroed in place FSDP2 adds the reduced shard into .grad: gradsync cannot overlap
# (see [Note: overlap] in gradsync/fsdp/replicate.py) and waits inside the hook instead.
CASES = [
    ("adamw", "mean", 1, True),
    ("adamw", "mean", 2, True),
    ("sgd_sum", "sum", 1, True),
    ("adamw", "item_mean", 2, True),
    ("adamw", "mean", 2, False),
]
TOL = 1e-12  # as in test_mesh.py: observed differences are float64 rounding, <= 1e-15


def batches(masked: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mesh_run.random_batches(CFG, BATCH, STEPS, masked=masked, seed=900)


def _train_case(mesh: Any, case: tuple) -> dict[str, Any]:
    opt_name, reduction, micro, set_to_none = case
    model = fsdp_run.make_model(CFG, mesh, DTYPE)
    sync = fsdp_run.parallelize(model, mesh, reduction)
    opt = OPTIMIZERS[opt_name](model.parameters())
    calls: list[tuple[str, frozenset[int]]] = []
    names = {sync.deadline.group: "ours", sync.shard_deadline.group: "ours (shard)"}
    in_flight = _watch_end_of_backward(sync)
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        ranks = frozenset(dist.get_process_group_ranks(group or dist.group.WORLD))
        calls.append((names.get(group, "other"), ranks))
        return real(tensor, **kwargs)

    data = batches(masked=reduction == "item_mean")
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        fsdp_run.train(
            model, sync, opt, data, mesh, reduction=reduction, micro_batches=micro,
            set_to_none=set_to_none,
        )  # fmt: skip
    finally:
        dist.all_reduce = real
    return {
        "params": full_parameters(model),
        "calls": calls,
        "in_flight": in_flight,
        "ours": frozenset(dist.get_process_group_ranks(sync.process_group)),
    }


def _watch_end_of_backward(sync: ReplicatedGradients) -> list[int]:
    """Record, at each end of backward, how many all-reduces were still to be waited for."""
    seen: list[int] = []
    finish = sync._finish

    def watched() -> None:
        seen.append(len(sync.pending))
        finish()

    sync._finish = watched  # type: ignore[method-assign]
    return seen


def _run(rank: int, world: int, layout: FSDPLayout, cases: list[tuple]) -> dict:
    mesh = layout.build_mesh()
    out: dict[Any, Any] = {case: _train_case(mesh, case) for case in cases}
    if layout.cp == 1:  # torch covers hybrid sharding itself: the same case, its way
        model = fsdp_run.train_torch_hsdp(CFG, mesh, OPTIMIZERS["adamw"], batches(False), DTYPE)
        out["torch_hsdp"] = full_parameters(model)
    return out


LAYOUTS = {
    "replicate2_shard2": FSDPLayout(replicate=2, shard=2),
    "shard2_cp2": FSDPLayout(shard=2, cp=2),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request: pytest.FixtureRequest) -> tuple[FSDPLayout, list[dict]]:
    layout = LAYOUTS[request.param]
    return layout, spawn(_run, layout.world_size, (layout, CASES), timeout_s=280)


def _reference(case: tuple) -> dict[str, torch.Tensor]:
    opt_name, reduction, _, _ = case
    data = batches(masked=reduction == "item_mean")
    return mesh_run.train_reference(
        CFG, OPTIMIZERS[opt_name], data, seed=0, dtype=DTYPE, reduction=reduction
    )


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.timeout(300)
def test_fsdp_with_gradsync_equals_one_process(trained: tuple) -> None:
    layout, results = trained
    for case in CASES:
        want = _reference(case)
        for rank, result in enumerate(results):
            diff = _max_diff(result[case]["params"], want)
            assert diff < TOL, (layout, case, rank, diff)


@pytest.mark.timeout(300)
def test_one_overlapped_all_reduce_per_group_over_gradsync_ranks_only(trained: tuple) -> None:
    # Per step: one all-reduce per FSDP2 group (the blocks and the root), all over gradsync's
    # ranks, every one still in flight when backward ends (overlapped) unless .grad was kept;
    # item_mean adds its item count (one over the shard ranks, one over gradsync's), and the
    # straggler timeline its records (the same pair). Nothing in the no-sync micro-batches.
    layout, results = trained
    groups = CFG.n_layer + 1
    for case in CASES:
        for rank, result in enumerate(results):
            got = result[case]
            ours = [ranks for name, ranks in got["calls"] if name == "ours"]
            pairs = 1 + (1 if case[1] == "item_mean" else 0)
            assert len(ours) == STEPS * (groups + pairs), (layout, case, rank, got["calls"])
            assert set(ours) == {got["ours"]}, (layout, case, rank, got["calls"])
            shard = [c for c in got["calls"] if c[0] == "ours (shard)"]
            assert len(shard) == STEPS * pairs, (layout, case, rank, got["calls"])
            if layout.cp == 1:  # with cp the model's own attention all-reduces over cp too
                assert len(got["calls"]) == STEPS * (groups + 2 * pairs), (case, got["calls"])
            # Kept gradients exist from the second step on: waited for inside the hook.
            overlapped = [groups] * STEPS if case[3] else [groups] + [0] * (STEPS - 1)
            assert got["in_flight"] == overlapped, (layout, case, rank)


@pytest.mark.timeout(300)
def test_gradsync_across_equals_torchs_own_hybrid_sharding(trained: tuple) -> None:
    # Same case, torch's HSDP (fully_shard over the 2-D mesh): the same bits. FSDP2 divides
    # by 2 before its reduce-scatter and by 2 after its all-reduce (float64), gradsync by 4
    # after both sums: every division by a power of two is exact, so nothing may differ.
    layout, results = trained
    if layout.cp > 1:
        pytest.skip("torch's hybrid sharding has no context-parallel axis")
    for rank, result in enumerate(results):
        ours, theirs = result[CASES[0]]["params"], result["torch_hsdp"]
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), (rank, name)
