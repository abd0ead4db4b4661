"""Mixed precision ([Note: main gradients]): a bf16 model whose gradients are accumulated and
reduced in fp32 equals one process accumulating the same micro-batch gradients in fp32, and
fp32 master weights stepped on them train as that process does. Real gloo ranks, one spawn."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.errors import UsageError
from gradsync.optim import MasterWeights
from gradsync.testing.spawn import spawn

WORLD, MICRO, STEPS = 2, 3, 3  # ranks, micro-batches per optimizer step, optimizer steps
TIMEOUT = 20.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )
    return model.to(torch.bfloat16)


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    # Inputs of very different scales make gradient elements of very different sizes: the
    # small ones are what a bf16 sum loses.
    x = torch.randn(8, 16, generator=g) * torch.logspace(-2, 1, 8).unsqueeze(1)
    return x.to(torch.bfloat16), torch.randn(8, 4, generator=g).to(torch.bfloat16)


def loss_of(model: nn.Module, step: int, rank: int, micro: int) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    return F.mse_loss(model(x).float(), y.float())


def reference_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    """One process: every rank's micro-batch gradients, as autograd gives them (bf16), summed in
    fp32 and divided by the number of ranks (the mean of the ranks' accumulated gradients)."""
    total = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for rank in range(WORLD):
        for micro in range(MICRO):
            model.zero_grad(set_to_none=True)
            loss_of(model, step, rank, micro).backward()
            for t, p in zip(total, model.parameters(), strict=True):
                t += p.grad.float()
    model.zero_grad(set_to_none=True)
    return [t / WORLD for t in total]


def reference_masters(
    model: nn.Module, optimizer: type, lr: float, clip: float = 0.0
) -> list[torch.Tensor]:
    """One process: fp32 master weights stepped by ``optimizer`` on :func:`reference_grads`
    (clipped to norm ``clip`` by torch if nonzero) and rounded into ``model`` after each step
    (what ``MasterWeights`` does)."""
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = optimizer(master, lr=lr)
    for step in range(STEPS):
        for m, g in zip(master, reference_grads(model, step), strict=True):
            m.grad = g
        if clip:
            torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master, strict=True):
                p.copy_(m)
    return [m.detach() for m in master]


def _window(wrapped: nn.Module, step: int, rank: int) -> None:
    for micro in range(MICRO):
        if micro < MICRO - 1:
            with wrapped.no_sync():
                loss_of(wrapped, step, rank, micro).backward()
        else:
            loss_of(wrapped, step, rank, micro).backward()


def _run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. One window: fp32 main gradients, and the plain bf16 path for contrast.
    for dtype in (torch.float32, None):
        model = make_model()
        wrapped = gradsync.DistributedDataParallel(model, main_grad_dtype=dtype, timeout=TIMEOUT)
        _window(wrapped, 0, rank)
        grads = [getattr(p, "main_grad", p.grad) for p in model.parameters()]
        out[f"grads {dtype}"] = [g.detach().clone() for g in grads]
        out[f"grad dtypes {dtype}"] = {str(p.grad.dtype) for p in model.parameters()}
    # The same window with bf16 on the wire: accumulation and the sum stay fp32.
    model = make_model()
    wrapped = gradsync.DistributedDataParallel(
        model, main_grad_dtype=torch.float32, compression="bf16", timeout=TIMEOUT
    )
    _window(wrapped, 0, rank)
    out["grads bf16 wire"] = [p.main_grad.clone() for p in model.parameters()]
    # A parameter no rank uses keeps .grad None, and the master weights skip it.
    model = WithUnused()
    wrapped = gradsync.DistributedDataParallel(
        model, main_grad_dtype=torch.float32, find_unused_parameters=True, timeout=TIMEOUT
    )
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-2)
    before = model.unused.detach().clone()
    _window(wrapped, 0, rank)
    out["unused grad"] = model.unused.grad
    opt.step()
    master = opt.master[[id(p) for p in opt.params].index(id(model.unused))]
    out["unused moved"] = not torch.equal(before.float(), master)  # fp32: sees any step
    # 2. Training: fp32 master weights stepped on the main gradients.
    model = make_model()
    wrapped = gradsync.DistributedDataParallel(
        model, main_grad_dtype=torch.float32, timeout=TIMEOUT
    )
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        _window(wrapped, step, rank)
        opt.step()
    out["master"] = [m.detach().clone() for m in opt.master]
    out["params"] = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=False)  # as a torch optimizer: zeros, not None
    out["zeroed"] = [None if p.grad is None else p.grad.abs().sum().item() for p in opt.params]
    # 3. Refused combinations, on every rank.
    errors = []
    bad = {"main_grad_dtype": torch.float32, "gradient_as_bucket_view": True}
    for kwargs in ({"main_grad_dtype": torch.int32}, bad):
        try:
            gradsync.DistributedDataParallel(make_model(), timeout=TIMEOUT, **kwargs)
        except UsageError as exc:
            errors.append(str(exc))
    try:
        wrapped.shard_optimizer(torch.optim.AdamW, lr=1e-2)
    except UsageError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    return out


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    pairs = zip(got, want, strict=True)
    return max(((g.float() - w).abs().max() / w.abs().max()).item() for g, w in pairs)


def test_main_grads_equal_one_process_accumulating_in_fp32() -> None:
    results = spawn(_run, WORLD)
    model = make_model()
    want = reference_grads(model, 0)
    for r in results:
        assert r["grad dtypes torch.float32"] == {"torch.bfloat16"}  # .grad: the model's dtype
        fp32_error = _relative_error(r["grads torch.float32"], want)
        bf16_error = _relative_error(r["grads None"], want)
        print(f"relative error: fp32 main grads {fp32_error:.2e}, bf16 {bf16_error:.2e}")
        # fp32 additions in another order: a few fp32 ulps.
        assert fp32_error < 1e-6, fp32_error
        # The same gradients summed in bf16 (autograd's accumulation, a bf16 all-reduce) are
        # off by bf16 roundings: the test can tell the two apart.
        assert bf16_error > 100 * max(fp32_error, 1e-8), (bf16_error, fp32_error)
        # One bf16 rounding of each rank's contribution and of the sum (compress.py's bound).
        assert _relative_error(r["grads bf16 wire"], want) < 2 * 2.0**-8
        assert r["unused grad"] is None and not r["unused moved"]
        assert len(r["errors"]) == 3
        assert "floating-point" in r["errors"][0] and "gradient_as_bucket_view" in r["errors"][1]
        assert "main_grad_dtype" in r["errors"][2]
    # One process with fp32 master weights and the same fp32-accumulated gradients.
    master = reference_masters(model, torch.optim.AdamW, 1e-2)
    for r in results:
        for got, m in zip(r["master"], master, strict=True):
            # Adam's update is sign-like: fp32 reorder noise in the gradient moves it ~1e-7.
            torch.testing.assert_close(got, m.detach(), rtol=0, atol=1e-5)
        for p, m in zip(r["params"], r["master"], strict=True):
            assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the rounded weights
        assert r["zeroed"] == [0.0] * len(r["params"]), r["zeroed"]
