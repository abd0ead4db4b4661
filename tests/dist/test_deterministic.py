"""The deterministic mode: the parameters are the same bits at any world size.

The GPT of the main job (smaller) trains in float32 on the same global batches at N = 1, 2, 3
and 4 (10 leaves per step: N = 3 and 4 do not divide them) for 50 steps, through a
``GlobalBatchSampler(deterministic=True)``, ``no_sync()`` accumulation and AdamW, and every
parameter after it must be ``torch.equal`` to N = 1's. The same in the default mode parts
already in float32 (checked too, so that the comparison can fail). A bf16 model with fp32 main
gradients and ``MasterWeights`` is the same bits at N = 1 and 3. A run moved from 4 ranks to 3
mid-run with the ``Checkpointer`` ends with the bits of the uninterrupted run. A short last step
(7 leaves of 10), ``reduction="mean"`` and ``"sum"`` too.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.comm.tree import leaf_range
from gradsync.data import GlobalBatchSampler
from gradsync.ddp.replan import autotune
from gradsync.optim import MasterWeights
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.leaf_steps import train_leaf_steps
from gradsync.testing.spawn import spawn
from gradsync.verify.report import format_report
from gradsync.verify.runner import VerifyConfig, verify

SEQS, BLOCK, LEAF, GLOBAL = 400, 16, 2, 20  # 10 leaves of 2 sequences per step
STEPS, MOVED_AT = 50, 25
# past the switch to the chosen plan and its trial: the steps after it run under the new plan
AUTO_STEPS = autotune.WARMUP_STEPS + autotune.PROFILE_STEPS + 2 * autotune.TRIAL_STEPS + 3


def _data(n: int = SEQS) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (n, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)).to(dtype)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run(rank: int, world: int, mode: str, reduction: str, length: int) -> dict[str, Any]:
    """Train ``STEPS`` steps (or one epoch of ``length`` sequences) at this world size."""
    deterministic = mode == "deterministic"
    sampler = GlobalBatchSampler(range(length), GLOBAL, LEAF, seed=1, deterministic=deterministic)
    leaves = sampler.leaves_per_step if deterministic else None
    model = _model()
    ddp = gradsync.DistributedDataParallel(model, reduction=reduction, deterministic=leaves)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    train_leaf_steps(ddp, opt, sampler, _data(), STEPS, reduction)
    return _params(model)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose values differ."""
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(600)
def test_the_gpt_is_the_same_bits_at_1_2_3_and_4_ranks() -> None:
    one = spawn(_run, 1, ("deterministic", "item_mean", SEQS))[0]
    for world in (2, 3, 4):
        for rank, got in enumerate(spawn(_run, world, ("deterministic", "item_mean", SEQS))):
            assert _equal(got, one) == [], (world, rank, _equal(got, one))
    # The default mode at 3 ranks: the same training to rounding, not to the bit.
    default_one = spawn(_run, 1, ("default", "item_mean", SEQS))[0]
    default_three = spawn(_run, 3, ("default", "item_mean", SEQS))[0]
    assert _equal(default_three, default_one), "float32 sums in another order gave equal bits"
    diff = max((default_three[k] - default_one[k]).abs().max().item() for k in one)
    assert diff < 1e-2, diff


def _run_auto(rank: int, world: int, cap: str) -> dict[str, Any]:
    """``AUTO_STEPS`` steps with buckets planned by ``cap``; with "auto" a bucket per parameter
    is chosen and kept (every step timed alike), so that the plan does change."""
    autotune.CANDIDATE_CAPS_MB = (0,)
    ticks = itertools.count()
    autotune._step_clock = lambda: float(next(ticks))
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True)
    model = _model()
    ddp = gradsync.DistributedDataParallel(
        model, reduction="item_mean", bucket_cap_mb=cap, deterministic=sampler.leaves_per_step
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    train_leaf_steps(ddp, opt, sampler, _data(), AUTO_STEPS, "item_mean")
    return {"params": _params(model), "buckets": ddp.num_buckets}


@pytest.mark.timeout(300)
def test_bucket_cap_auto_changes_the_plan_and_no_bit() -> None:
    # [Note: a new bucket plan changes no sum] in ddp/deterministic.py
    one = spawn(_run_auto, 1, ("scaled",))[0]
    assert one["buckets"] == 1
    for world in (2, 3):
        for rank, got in enumerate(spawn(_run_auto, world, ("auto",))):
            assert got["buckets"] == len(one["params"]) - 1, got["buckets"]  # the attn mask
            assert _equal(got["params"], one["params"]) == [], (world, rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mean_and_sum_and_a_short_last_step_are_the_same_bits(reduction: str) -> None:
    # 54 sequences: steps of 20, 20 and 14, the last one 7 leaves of 10; at 3 and at 4 ranks
    # the last rank's block lies past the 7th, so it runs none and waits in join().
    length = 2 * GLOBAL + 14
    one = spawn(_run_epoch, 1, (reduction, length))[0]
    for world in (3, 4):
        for rank, got in enumerate(spawn(_run_epoch, world, (reduction, length))):
            assert _equal(got, one) == [], (world, rank, _equal(got, one))


def _run_epoch(rank: int, world: int, reduction: str, length: int) -> dict[str, Any]:
    sampler = GlobalBatchSampler(range(length), GLOBAL, LEAF, seed=1, deterministic=True)
    model = _model()
    ddp = gradsync.DistributedDataParallel(
        model, reduction=reduction, deterministic=sampler.leaves_per_step
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 if reduction == "mean" else 0.002)
    loader = DataLoader(_data(length), batch_sampler=sampler)
    with ddp.join(opt):
        for (x, y), last in sampler.mark_step_ends(loader):
            with ddp.no_sync() if not last else _nothing():
                loss = lm_loss(ddp(x), y, reduction=reduction)
                loss.backward()
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return _params(model)


def _run_master(rank: int, world: int) -> dict[str, Any]:
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True)
    model = _model(torch.bfloat16)
    ddp = gradsync.DistributedDataParallel(
        model, reduction="item_mean", main_grad_dtype=torch.float32,
        deterministic=sampler.leaves_per_step,
    )  # fmt: skip
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=3e-3)
    train_leaf_steps(ddp, opt, sampler, _data(), 20, "item_mean")
    return {**_params(model), **{f"master{i}": m.detach() for i, m in enumerate(opt.master)}}


@pytest.mark.timeout(300)
def test_bf16_parameters_with_fp32_main_gradients_are_the_same_bits() -> None:
    one = spawn(_run_master, 1)[0]
    for rank, got in enumerate(spawn(_run_master, 3)):
        assert _equal(got, one) == [], (rank, _equal(got, one))


def _moved(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True)
    model = _model()
    ddp = gradsync.DistributedDataParallel(
        model, reduction="item_mean", deterministic=sampler.leaves_per_step
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    ckpt = Checkpointer(root, model=ddp, optimizer=opt, sampler=sampler, timeout=60)
    if phase == "first":
        train_leaf_steps(ddp, opt, sampler, _data(), MOVED_AT, "item_mean")
        ckpt.save(MOVED_AT)
        return {}
    assert ckpt.load() == MOVED_AT
    assert dist.get_world_size() == world
    train_leaf_steps(ddp, opt, sampler, _data(), STEPS, "item_mean")
    return _params(model)


@pytest.mark.timeout(300)
def test_a_run_moved_from_4_ranks_to_3_ends_with_the_uninterrupted_bits(tmp_path: Path) -> None:
    uninterrupted = spawn(_run, 4, ("deterministic", "item_mean", SEQS))[0]
    spawn(_moved, 4, (str(tmp_path), "first"))
    for rank, got in enumerate(spawn(_moved, 3, (str(tmp_path), "second"))):
        assert _equal(got, uninterrupted) == [], (rank, _equal(got, uninterrupted))


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Each setting the mode cannot keep its promise with, and a rank that runs one leaf too
    many: the error each rank raised."""
    out: dict[str, str] = {}
    leaves = 10

    def attempt(name: str, make: Any) -> None:
        try:
            make()
        except (gradsync.GradsyncError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    def wrap(model: nn.Module | None = None, **kw: Any) -> Any:
        return gradsync.DistributedDataParallel(model or _model(), deterministic=leaves, **kw)

    attempt("compression", lambda: wrap(compression="bf16"))
    attempt("algorithm", lambda: wrap(algorithm="ring"))
    attempt("zero", lambda: wrap().shard_optimizer(torch.optim.AdamW, lr=0.1, fused=True))
    attempt("hook", lambda: wrap().register_comm_hook(None, lambda s, b: None))
    attempt("buffers", lambda: wrap(nn.BatchNorm1d(4)))
    attempt("leaves", lambda: gradsync.DistributedDataParallel(_model(), deterministic=True))
    torch.set_num_threads(1 + rank)
    attempt("threads", lambda: wrap())
    torch.set_num_threads(1)
    ddp = wrap(reduction="sum")
    block = leaf_range(leaves, world, rank)
    extra = int(rank == 1)  # rank 1 runs one leaf more than its block
    x = torch.randint(0, 64, (2, BLOCK))

    def step() -> None:
        for i in range(len(block) + extra):
            with ddp.no_sync() if i < len(block) + extra - 1 else _nothing():
                ddp(x).sum().backward()

    attempt("extra leaf", step)
    return out


@pytest.mark.timeout(300)
def test_what_breaks_the_promise_is_refused_on_every_rank() -> None:
    said = spawn(_refusals, 3)
    for rank, out in enumerate(said):
        assert "bf16" in out["compression"] and "rounds partial sums" in out["compression"]
        assert "algorithm='ring'" in out["algorithm"]
        assert "shard_optimizer(AdamW" in out["zero"] and "fused=False" in out["zero"]
        assert all(f"rank {r}: stepping pieces" in out["zero"] for r in range(3)), out["zero"]
        assert "register_comm_hook cannot be combined with deterministic=" in out["hook"]
        assert "broadcast_buffers=False" in out["buffers"]
        assert "positive int" in out["leaves"]
        assert "torch.get_num_threads()" in out["threads"], (rank, out["threads"])
        assert "rank 1 ran 5 leaves" in out["extra leaf"], (rank, out["extra leaf"])  # 4 + 1


@pytest.mark.timeout(300)
def test_gradsync_verify_says_bitwise_identical() -> None:
    report = verify(VerifyConfig(world_size=3, steps=3, deterministic=6))
    text = format_report(report)
    assert report.passed, text
    assert "3-rank training is bitwise identical to its definition" in text, text


def _one_rank_missing(rank: int, world: int) -> str:
    ddp = gradsync.DistributedDataParallel(_model(), deterministic=world, timeout=2.0)
    x = torch.randint(0, 64, (2, BLOCK))
    ddp(x).sum().backward()
    if rank == 2:
        ddp(x)
        return "not there"  # never runs the second step's backward
    try:
        ddp(x).sum().backward()
    except gradsync.CollectiveTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_come_is_named_within_the_deadline() -> None:
    said = spawn(_one_rank_missing, 3)
    for rank in (0, 1):
        assert "rank 2" in said[rank] and "leaf count" in said[rank], said[rank]
