"""The deterministic mode on a dp x tp device mesh: the same bits at dp = 1, 2 and 3, resumed too.

A GPT whose attention and MLP are tensor-parallel DTensors over a tp axis of 2 (torch's
``parallelize_module``) trains under ``device_mesh=mesh["dp"]`` and ``deterministic=10``, its
leaves cut by ``GlobalBatchSampler(deterministic=True)`` over the dp ranks, at dp = 1, 2 and 3
(2, 4 and 6 processes). Every parameter's full tensor must be ``torch.equal`` at every dp size
and on every rank, and so must a run saved at dp = 3 mid-run and resumed at dp = 2, and a
sequence-parallel net whose norm's gradients come out ``Partial`` over tp. A mesh of
two data-parallel axes (dp x cp) is refused on every rank, naming them, and so are leaves cut
over every rank instead of the dp axis, naming the fix.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.errors import UsageError
from gradsync.testing.gpt import GPT, GPTConfig
from gradsync.testing.leaf_steps import train_leaf_steps
from gradsync.testing.parallel import (
    SP_DIM,
    apply_tensor_parallel,
    full_parameters,
    sequence_parallel_net,
)
from gradsync.testing.spawn import spawn

SEQS, BLOCK, LEAF, GLOBAL = 120, 8, 2, 20  # 10 leaves of 2 sequences per step
STEPS, MOVED_AT, TP = 6, 3, 2
CFG = GPTConfig(vocab_size=29, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16)
CAP_MB = 3_000 / 2**20  # a few buckets


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (SEQS, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _setup(mesh: Any) -> tuple[Any, Any, Any, GlobalBatchSampler]:
    dp = mesh["dp"].size()
    dp_mesh = mesh["dp"]
    where = {"num_replicas": dp, "rank": dp_mesh.get_local_rank()}
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True, **where)
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_tensor_parallel(model, mesh["tp"])
    ddp = gradsync.DistributedDataParallel(
        model,
        device_mesh=dp_mesh,
        reduction="item_mean",
        deterministic=sampler.leaves_per_step,
        bucket_cap_mb=CAP_MB,
        timeout=60,
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    return model, ddp, opt, sampler


def _sequence_parallel(mesh: Any) -> dict[str, torch.Tensor]:
    """The sequence-parallel net (its norm's gradients come out Partial over tp), 10 leaves of
    one sequence a step: reduced over tp as a bucket takes each leaf, never two leaves added
    first, or a pair of leaves that N puts on two ranks would round another way."""
    dp_mesh = mesh["dp"]
    x = torch.randn(40, 6, SP_DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    where = {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
    sampler = GlobalBatchSampler(range(len(x)), 10, 1, seed=2, deterministic=True, **where)
    model = sequence_parallel_net(mesh)
    ddp = gradsync.DistributedDataParallel(
        model, device_mesh=dp_mesh, reduction="sum", deterministic=10, timeout=60
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    for (batch,), last in sampler.mark_step_ends(
        DataLoader(TensorDataset(x), batch_sampler=sampler)
    ):
        with contextlib.nullcontext() if last else ddp.no_sync():
            ddp(batch).pow(2).sum().backward()
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return full_parameters(model)


def _refused(world: int) -> str:
    """A mesh of dp x cp passed whole: its message (raised on this rank)."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    with pytest.raises(UsageError) as raised:
        gradsync.DistributedDataParallel(GPT(CFG), device_mesh=mesh["dp", "cp"], deterministic=10)
    return str(raised.value)


def _run(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``phase``: "whole" (STEPS steps), "first" (MOVED_AT steps, saved) or "resumed" (loaded
    from that save, trained to STEPS). Returns every full parameter."""
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model, ddp, opt, sampler = _setup(mesh)
    ckpt = Checkpointer(root, model=ddp, optimizer=opt, sampler=sampler, timeout=60)
    if phase == "first":
        train_leaf_steps(ddp, opt, sampler, _data(), MOVED_AT)
        ckpt.save(MOVED_AT)
        return {}
    if phase == "resumed":
        assert ckpt.load() == MOVED_AT
    train_leaf_steps(ddp, opt, sampler, _data(), STEPS)
    out: dict[str, Any] = {"params": full_parameters(model)}
    out["dtensors"] = sum(
        isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()
    )
    if phase == "whole":
        out["sequence_parallel"] = _sequence_parallel(mesh)
    if world == TP and phase == "whole":
        out["refused"] = _refused(world)
    return out


def _wrong_sampler(rank: int, world: int) -> str:
    """Leaves cut over every rank, not over the data-parallel axis: what this rank raised."""
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model, ddp, opt, _ = _setup(mesh)
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True)
    try:
        train_leaf_steps(ddp, opt, sampler, _data(), 1)
    except Exception as exc:  # a tp peer that raised first ends this rank's collectives too
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, value in want.items() if not torch.equal(got[name], value)]


@pytest.mark.timeout(300)
def test_dp_x_tp_gives_the_same_bits_at_every_dp_size_and_across_a_resume(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    # Fresh processes: in a pooled worker that had run another test's sequence-parallel net,
    # this one's parameters came out on a device mesh whose process group no longer existed
    # (state torch keeps per process, which the pool does not put back).
    runs = {dp: spawn(_run, dp * TP, (root, "whole"), fresh=True) for dp in (1, 2, 3)}
    spawn(_run, 3 * TP, (root, "first"))
    want = runs[1][0]["params"]
    assert runs[1][0]["dtensors"] > 0
    for dp, results in runs.items():
        for rank, got in enumerate(results):
            assert _differ(got["params"], want) == [], (dp, rank)
            sequence_parallel = runs[1][0]["sequence_parallel"]
            assert _differ(got["sequence_parallel"], sequence_parallel) == [], (dp, rank)
    for rank, got in enumerate(spawn(_run, 2 * TP, (root, "resumed"))):
        assert _differ(got["params"], want) == [], ("resumed at dp=2", rank)
    for result in runs[1]:
        assert "2 data-parallel axes ('dp', 'cp')" in result["refused"], result["refused"]


@pytest.mark.timeout(120)
def test_leaves_cut_over_every_rank_instead_of_the_dp_axis_are_refused_naming_the_fix() -> None:
    # Fresh processes: a rank that raised ends, so that its tp peer's collectives fail too.
    errors = spawn(_wrong_sampler, 2 * TP, fresh=True, return_failures=True, timeout_s=60)
    assert all("no error" != str(e) for e in errors), errors
    named = [e for e in errors if isinstance(e, str) and e.startswith("UsageError")]
    assert named and all("num_replicas=mesh['dp'].size()" in e for e in named), errors
