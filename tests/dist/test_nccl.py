"""On a CUDA machine: gradsync on NCCL gives the same numbers as on gloo and as one process.

Only one GPU may be present, and NCCL allows one rank per GPU, so this runs at world size 1:
it still goes through the whole hook, bucket, launch and write-back path on CUDA streams.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.spawn import spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL"
)
STEPS = 5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 32, (8, 32), generator=g)
    return x.cuda(), torch.roll(x, -1, dims=1).cuda()


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=4, n_embd=64)).cuda()


def _fit(model: torch.nn.Module, wrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Train ``model`` for STEPS steps, calling it through ``wrapped``; its final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        lm_loss(wrapped(x), y).backward()
        opt.step()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _train(rank: int, world: int, bucket_cap_mb: float | None) -> dict[str, torch.Tensor]:
    torch.use_deterministic_algorithms(True)
    model = _model()
    return _fit(model, gradsync.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb))


def test_nccl_equals_gloo_and_single_process() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    model = _model()
    reference = _fit(model, model)
    for cap in (0, 25.0):
        nccl = spawn(_train, 1, (cap,), backend="nccl")[0]
        gloo = spawn(_train, 1, (cap,), backend="gloo")[0]  # gloo, on the same CUDA tensors
        for name, ref in reference.items():
            # Same kernels, deterministic mode, a world of one: bit-identical results expected.
            assert torch.equal(nccl[name], gloo[name]), (cap, name)
            assert torch.equal(nccl[name], ref), (cap, name, (nccl[name] - ref).abs().max())


def _train_variant(rank: int, world: int, variant: str) -> dict[str, torch.Tensor]:
    """One of gradsync's communication paths on CUDA tensors over NCCL, at world size 1."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.use_deterministic_algorithms(True)
    model = _model()
    if variant == "bf16 wire":
        wrapped = gradsync.DistributedDataParallel(model, compression="bf16")
    else:
        wrapped = gradsync.DistributedDataParallel(model)
    if variant == "torch bf16_compress_hook":
        wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if variant == "sharded optimizer":
        opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(STEPS):
            x, y = _batch(step)
            lm_loss(wrapped(x), y).backward()
            opt.step()
        wrapped(_batch(0)[0])  # the last all-gather lands before the parameters are read
        return {n: p.detach().cpu() for n, p in model.named_parameters()}
    return _fit(model, wrapped)


@pytest.mark.parametrize(
    "variant",
    ["bf16 wire", "torch bf16_compress_hook", "sharded optimizer"],
)
def test_comm_paths_run_on_nccl(variant: str) -> None:
    """At world size 1 a sum is the identity: every path must give one process's numbers,
    up to the bf16 rounding of the torch hook (which rounds even a world of one). PowerSGD is
    not here: it approximates even a world of one's gradient, so it has no exact reference."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    model = _model()
    reference = _fit(model, model)
    got = spawn(_train_variant, 1, (variant,), backend="nccl")[0]
    for name, ref in reference.items():
        if variant == "torch bf16_compress_hook":
            torch.testing.assert_close(got[name], ref, rtol=0, atol=5e-3)
        else:
            assert torch.equal(got[name], ref), (variant, name, (got[name] - ref).abs().max())
