"""A device mesh given wrongly fails on every rank with an error that names the fault, and a
``Partial`` gradient (sequence parallelism) is summed over tp before it is averaged over dp."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import gradsync
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPTConfig
from gradsync.testing.mesh_run import Layout
from gradsync.testing.parallel import (
    SP_DIM,
    apply_tensor_parallel,
    full_parameters,
    sequence_parallel_net,
)
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
SEQ, BATCH, STEPS = 6, 4, 3


def _sp_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, SEQ, SP_DIM, generator=g, dtype=torch.float64)


def _sp_train(mesh: Any, naive: bool) -> dict[str, Any]:
    model = sequence_parallel_net(mesh)
    dp_mesh = mesh["dp"]
    wrapped: nn.Module = model
    if not naive:
        wrapped = gradsync.DistributedDataParallel(model, device_mesh=dp_mesh, timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    partial_seen = False
    for step in range(STEPS):
        x = _sp_batch(step).chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
        opt.zero_grad()
        wrapped(x).pow(2).mean().backward()
        if naive:
            partial_seen |= any(p.is_partial() for p in model.ln.weight.grad.placements)
            gradsync.average_gradients(model, device_mesh=dp_mesh)
        opt.step()
    grad = model.ln.weight.grad
    return {
        "params": full_parameters(model),
        "partial_seen": partial_seen,
        "ln_grad": (type(grad).__name__, tuple(grad.placements)),
    }


def _sp_reference() -> dict[str, torch.Tensor]:
    model = sequence_parallel_net(None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        model(_sp_batch(step)).pow(2).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _error_of(fn: Any) -> str:
    try:
        fn()
    except gradsync.GradsyncError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mistakes(mesh: Any) -> dict[str, str]:
    def wrap(**kwargs: Any) -> None:
        model = mesh_run.make_model(CFG, mesh, seed=0, dtype=torch.float64)
        gradsync.DistributedDataParallel(model, timeout=30, **kwargs)

    def mismatched() -> None:
        # Data-parallel rank 1 parallelised only the qkv projection: the rest is plain there.
        torch.manual_seed(0)
        model = mesh_run.GPT(CFG).double()
        if mesh["dp"].get_local_rank() == 0:
            apply_tensor_parallel(model, mesh["tp"])
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            parallelize_module(model, mesh["tp"], {"blocks.0.attn.qkv": ColwiseParallel()})
        gradsync.DistributedDataParallel(model, device_mesh=mesh["dp"], timeout=30)

    return {
        "tp_in_data_mesh": _error_of(lambda: wrap(device_mesh=mesh["dp", "tp"])),
        "both": _error_of(lambda: wrap(device_mesh=mesh["dp"], process_group=dist.group.WORLD)),
        "not_a_mesh": _error_of(lambda: wrap(device_mesh="dp")),
        "mismatched": _error_of(mismatched),
    }


def _gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(300 + step)
        shape = (BATCH, CFG.block_size)
        out.append(
            (torch.randint(0, 13, shape, generator=g), torch.randint(0, 13, shape, generator=g))
        )
    return out


def _join(mesh: Any) -> dict[str, torch.Tensor]:
    """Data-parallel rank 1 (both its tp ranks) runs out of data one step early."""
    model = mesh_run.make_model(CFG, mesh, seed=0, dtype=torch.float64)
    ddp = gradsync.DistributedDataParallel(model, device_mesh=mesh["dp"], timeout=60)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = _gpt_batches()
    if mesh["dp"].get_local_rank() == 1:
        data = data[:-1]
    with ddp.join(opt):
        mesh_run.train(ddp, opt, data, mesh)
    return full_parameters(model)


def _join_reference() -> dict[str, torch.Tensor]:
    """One process trained on exactly the batches that existed: the last step has only the
    rows of data-parallel rank 0."""
    data = _gpt_batches()
    tokens, targets = data[-1]
    data[-1] = (tokens[: BATCH // 2], targets[: BATCH // 2])
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    return mesh_run.train_reference(CFG, sgd, data, seed=0, dtype=torch.float64)


def _run(rank: int, world: int) -> dict[str, Any]:
    mesh = Layout(dp=2, tp=2).build_mesh()
    return {
        "join": _join(mesh),
        "mistakes": _mistakes(mesh),
        "wrapper": _sp_train(mesh, naive=False),
        "naive": _sp_train(mesh, naive=True),
    }


def test_mesh_mistakes_and_partial_gradients() -> None:
    results = spawn(_run, 4)
    want = _sp_reference()
    want_join = _join_reference()
    for rank, result in enumerate(results):
        # join() with tensor parallelism: float64 rounding only, as in test_mesh.py.
        diff = max((result["join"][n] - want_join[n]).abs().max().item() for n in want_join)
        assert diff < 1e-12, (rank, diff)
        m = result["mistakes"]
        assert m["tp_in_data_mesh"].startswith("UsageError"), (rank, m)
        assert "'tp'" in m["tp_in_data_mesh"] and "Shard" in m["tp_in_data_mesh"], m
        assert "blocks.0." in m["tp_in_data_mesh"], m  # names the parameter
        assert m["both"].startswith("UsageError") and "not both" in m["both"], m
        assert m["not_a_mesh"].startswith("UsageError") and "DeviceMesh" in m["not_a_mesh"]
        assert m["mismatched"].startswith("ModelMismatchError"), (rank, m)
        assert "blocks.0.attn.proj.weight" in m["mismatched"], m
        assert "Shard(dim=1)" in m["mismatched"] and "rank 1" in m["mismatched"], m
        for how in ("wrapper", "naive"):
            got = result[how]
            # Float64, 3 SGD steps: rounding differences only (observed ~1e-16). Averaging the
            # Partial norm gradients over dp without first summing them over tp leaves them
            # half-size: a difference of ~1e-2.
            diff = max((got["params"][n] - want[n]).abs().max().item() for n in want)
            assert diff < 1e-12, (rank, how, diff)
            assert got["ln_grad"] == ("DTensor", (Replicate(),)), got["ln_grad"]
        assert result["naive"]["partial_seen"]  # the case under test really arises
    assert isinstance(DTensor, type)
