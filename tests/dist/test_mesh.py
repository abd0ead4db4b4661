"""Data parallelism inside a (dp, cp, tp) device mesh equals one process on the global batch.

Each layout is one spawn running a grid of cases: optimizers, bucket caps, no_sync
accumulation, item_mean with uneven valid tokens per context-parallel chunk. Tensor-parallel
parameters are DTensors (torch's ``parallelize_module``); context parallelism splits every
sequence into chunks with attention over the earlier ones (``gradsync.testing.parallel``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import gradsync
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPTConfig
from gradsync.testing.mesh_run import Layout
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
BATCH, STEPS = 8, 3
DTYPE = torch.float64  # float64: a sync bug shows as a difference ~1e-3, rounding as ~1e-15
SMALL_CAP_MB = 600 / 2**20  # buckets of a few parameters
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    # For summed losses: the gradient is ~64x (the tokens of the batch) a mean loss's.
    "sgd_sum": lambda ps: torch.optim.SGD(ps, lr=0.1 / 64, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
}
# (optimizer, bucket cap, reduction, micro-batches per step, other options)
CASES = [
    ("sgd", 0, "mean", 1, ()),
    ("adamw", SMALL_CAP_MB, "mean", 2, ()),
    ("adamw", None, "item_mean", 1, ()),
]
# Every other option, unchanged with a mesh: gradsync's own ring all-reduce, replica checks
# every step (checksums of DTensor shards), NaN/Inf checks, the sum reduction.
OPTIONS_CASE = (
    "sgd_sum",
    SMALL_CAP_MB,
    "sum",
    1,
    (("algorithm", "ring"), ("check_replicas_every", 1), ("check_finite", True)),
)


def batches(masked: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mesh_run.random_batches(CFG, BATCH, STEPS, masked=masked, seed=700)


def _count_all_reduces(calls: list[frozenset[int]]) -> Any:
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        pg = group if group is not None else dist.group.WORLD
        calls.append(frozenset(dist.get_process_group_ranks(pg)))
        return real(tensor, *args, group=group, **kwargs)

    return counting


def _train_case(mesh: Any, case: tuple, count: bool) -> dict[str, Any]:
    opt_name, cap, reduction, micro, options = case
    # Replicas start different (seeded by their data-parallel index): the wrapper must
    # broadcast the first data-parallel rank's weights, separately for each tp shard.
    dp_index = mesh_run.data_parallel_index(mesh)
    model = mesh_run.make_model(CFG, mesh, seed=17 * dp_index, dtype=DTYPE)
    ddp = gradsync.DistributedDataParallel(
        model,
        device_mesh=mesh_run.data_parallel_mesh(mesh),
        bucket_cap_mb=cap,
        reduction=reduction,
        gradient_as_bucket_view=cap == 0,  # DTensor gradients that are views into buckets
        timeout=60,
        **dict(options),
    )
    opt = OPTIMIZERS[opt_name](ddp.parameters())
    calls: list[frozenset[int]] = []
    data = batches(masked=reduction == "item_mean")
    if count:  # the collectives of one step, past construction
        mesh_run.train(ddp, opt, data[:1], mesh, reduction=reduction, micro_batches=micro)
        real = dist.all_reduce
        dist.all_reduce = _count_all_reduces(calls)
        try:
            mesh_run.train(ddp, opt, data[1:2], mesh, reduction=reduction, micro_batches=micro)
        finally:
            dist.all_reduce = real
        data = data[2:]
    mesh_run.train(ddp, opt, data, mesh, reduction=reduction, micro_batches=micro)
    grads_ok = all(
        isinstance(p.grad, DTensor) == isinstance(p, DTensor)
        and (not isinstance(p, DTensor) or p.grad.placements == p.placements)
        for p in model.parameters()
    )
    return {
        "params": full_parameters(model),
        "grads_keep_placements": grads_ok,
        "num_dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
        "num_buckets": ddp.num_buckets,
        "calls": calls,
        "dp_ranks": frozenset(dist.get_process_group_ranks(ddp.process_group)),
        "tp_ranks": frozenset(dist.get_process_group_ranks(mesh["tp"].get_group())),
    }


def _run(
    rank: int, world: int, layout: Layout, cases: list[tuple], count: bool, extras: tuple = ()
) -> dict:
    mesh = layout.build_mesh()
    out: dict[Any, Any] = {case: _train_case(mesh, case, count) for case in cases}
    for extra in extras:
        out[extra] = EXTRAS[extra](mesh)
    return out


def _forget_cp(mesh: Any) -> dict[str, torch.Tensor]:
    """The classic mistake: data parallelism over dp only, while cp ranks hold other chunks."""
    model = mesh_run.make_model(CFG, mesh, seed=0, dtype=DTYPE)
    ddp = gradsync.DistributedDataParallel(model, device_mesh=mesh["dp"], timeout=60)
    opt = OPTIMIZERS["adamw"](ddp.parameters())
    mesh_run.train(ddp, opt, batches(masked=False), mesh)
    return full_parameters(model)


def _fsdp_then_cp(mesh: Any) -> dict[str, torch.Tensor]:
    """torch's FSDP2 shards over dp and reduces gradients there; average_gradients adds cp."""
    from torch.distributed.fsdp import fully_shard

    model = mesh_run.make_model(CFG, mesh, seed=0, dtype=DTYPE)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = OPTIMIZERS["adamw"](model.parameters())
    for batch in batches(masked=False):
        tokens, targets = mesh_run.rank_part(batch, mesh)
        opt.zero_grad()
        mesh_run.micro_batch_loss(model, (tokens, targets), "mean", 1).backward()
        gradsync.average_gradients(model, device_mesh=mesh["cp"])
        opt.step()
    return full_parameters(model)


EXTRAS = {"forget_cp": _forget_cp, "fsdp_then_cp": _fsdp_then_cp}


# Float64 parameters of order 1 after 3 steps. The mesh run splits every sum (over batch rows,
# over sequence chunks, over tp shards of a matmul) differently from the single process, so
# results differ by float64 rounding: observed <= 3e-16. AdamW's normalisation can amplify
# that where a second moment is tiny, hence the margin. A missing reduction over an axis moves
# parameters by ~1e-3 (see the "forget_cp" check below).
TOL = 1e-12


def _check(results: list[dict], layout: Layout, cases: list[tuple]) -> None:
    for case in cases:
        opt_name, _, reduction, _, _ = case
        want = mesh_run.train_reference(
            CFG,
            OPTIMIZERS[opt_name],
            batches(masked=reduction == "item_mean"),
            seed=0,
            dtype=DTYPE,
            reduction=reduction,
        )
        for rank, result in enumerate(results):
            got = result[case]
            diff = max((got["params"][n] - want[n]).abs().max().item() for n in want)
            assert diff < TOL, (layout, case, rank, diff)
            assert got["grads_keep_placements"], (layout, case, rank)
            assert (got["num_dtensors"] > 0) == (layout.tp > 1)


# name: (layout, cases, count collectives, extra checks). The 8-rank layout runs once, with
# every feature in one case: a small cap, no_sync accumulation, item_mean on uneven chunks.
LAYOUTS = {
    "dp2_tp2": (Layout(dp=2, tp=2), [*CASES, OPTIONS_CASE], True, ()),
    "dp2_cp2": (Layout(dp=2, cp=2), CASES, False, ("fsdp_then_cp",)),
    "dp1_tp2": (Layout(dp=1, tp=2), CASES, False, ()),
    "dp1_cp2": (Layout(dp=1, cp=2), CASES, False, ("forget_cp",)),
    "dp2_cp2_tp2": (
        Layout(dp=2, cp=2, tp=2),
        [("adamw", SMALL_CAP_MB, "item_mean", 2, ())],
        True,
        (),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.timeout(300)
def test_mesh_training_equals_one_process(name: str) -> None:
    layout, cases, count, extras = LAYOUTS[name]
    results = spawn(_run, layout.world_size, (layout, cases, count, extras), timeout_s=280)
    _check(results, layout, cases)
    for result in results:
        for case in cases if count else ():
            if case[4]:  # the ring all-reduce sends point to point; counted in test_algorithms
                continue
            got = result[case]
            # Exactly one collective per bucket, all over the data-parallel ranks (dp x cp),
            # none over tp; item_mean adds its one item-count exchange, on the same ranks.
            # (The model's own context-parallel attention all-reduces over cp in backward.)
            extra = 1 if case[2] == "item_mean" else 0
            on_dp = [c for c in got["calls"] if c == got["dp_ranks"]]
            assert len(on_dp) == got["num_buckets"] + extra, (case, got["calls"])
            assert got["tp_ranks"] not in set(got["calls"])
            if layout.cp == 1:
                assert len(got["calls"]) == len(on_dp)
        if "fsdp_then_cp" in extras:
            want = mesh_run.train_reference(
                CFG, OPTIMIZERS["adamw"], batches(False), seed=0, dtype=DTYPE
            )
            diff = max((result["fsdp_then_cp"][n] - want[n]).abs().max().item() for n in want)
            assert diff < TOL, diff
        if "forget_cp" in extras:
            # The test has teeth: leaving cp out of the data-parallel mesh trains each chunk's
            # rank on its own partial gradient, far outside the tolerance.
            want = mesh_run.train_reference(
                CFG, OPTIMIZERS["adamw"], batches(False), seed=0, dtype=DTYPE
            )
            diff = max((result["forget_cp"][n] - want[n]).abs().max().item() for n in want)
            assert diff > 1e-4, diff
