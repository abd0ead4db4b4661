"""Gradients with a graph (real gloo ranks, one spawn of 2): ``backward(create_graph=True)``
under every reduction, a second backward through ``.grad``, the settings that cannot keep the
graph, and ``torch.autograd.grad(..., create_graph=True)`` in the loss and in the forward.

What each rank is promised ([Note: gradients with a graph] in ``ddp/checks/graph_grads.py``):
``.grad`` holds the full batch's gradient, bit for bit the one a plain backward gives, and its
graph is the rank's own gradient's; a penalty on the inputs' gradient and forces computed in
the forward train as one process does."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.testing.spawn import spawn

from toy import outcome

WORLD, GLOBAL, STEPS = 2, 8, 3
REDUCTIONS = ("mean", "sum", "item_mean")


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Energy(Critic):
    """Returns the forces ``-dE/dx``: ``torch.autograd.grad(create_graph=True)`` in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            energy = super().forward(x).pow(2).sum()  # squared: the forces depend on b.bias
            (forces,) = torch.autograd.grad(-energy, x, create_graph=True)
        return forces


def new(cls: type[nn.Module] = Critic) -> nn.Module:
    torch.manual_seed(0)
    return cls().double()


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return (torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64))  # fmt: skip


def share(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = GLOBAL // world
    return t[rank * n : (rank + 1) * n]


def local_loss(model: nn.Module, x: torch.Tensor, reduction: str) -> torch.Tensor:
    """This rank's loss; each reduction combines the ranks' gradients into the full batch's
    mean squared output (``"sum"`` of per-rank losses already divided by the global batch)."""
    out = model(x).pow(2).sum()
    return out / len(x) if reduction == "mean" else out / GLOBAL if reduction == "sum" else out


def counted_loss(model: gradsync.DistributedDataParallel, x: torch.Tensor, reduction: str
                 ) -> torch.Tensor:  # fmt: skip
    loss = local_loss(model, x, reduction)
    if reduction == "item_mean":
        model.count_items(len(x))
    return loss


def gp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's penalty: the critic's gradient with respect to its inputs, per sample."""
    x = x.detach().requires_grad_(True)
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return y.mean() + ((gx.norm(dim=1) - 1) ** 2).mean()


def force_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), target)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _create_graph(rank: int, world: int, reduction: str) -> dict[str, Any]:
    x = share(data(0)[0], rank, world)
    plain = gradsync.DistributedDataParallel(new(), reduction=reduction, timeout=20)
    counted_loss(plain, x, reduction).backward()
    model = gradsync.DistributedDataParallel(new(), reduction=reduction, timeout=20)
    loss = counted_loss(model, x, reduction)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.backward(create_graph=True)
    params = list(model.parameters())
    # A Hessian-vector product through .grad, with v all ones.
    hv = torch.autograd.grad(sum(p.grad.sum() for p in params), params, retain_graph=True)
    got = {
        "same_bits": all(
            torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), params, strict=True)
        ),
        "graph": all(p.grad.requires_grad for p in params),
        "grads": [p.grad.detach().clone() for p in params],
        "hv": [h.detach().clone() for h in hv],
        "warned": any("create_graph=True" in str(w.message) for w in caught),
    }
    return {**got, "second": outcome(lambda: sum((p.grad**2).sum() for p in params).backward())}


def _refused(rank: int, world: int, **kw: Any) -> str:
    dtype = torch.float32 if "main_grad_dtype" in kw else torch.float64
    model = gradsync.DistributedDataParallel(new().to(dtype), timeout=20, **kw)
    x = share(data(0)[0], rank, world).to(dtype)
    return outcome(lambda: model(x).pow(2).mean().backward(create_graph=True))


def _train(rank: int, world: int, which: str) -> list[torch.Tensor]:
    model = gradsync.DistributedDataParallel(new(Energy if which == "forces" else Critic),
                                             timeout=20)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, target = (share(t, rank, world) for t in data(step))
        loss = force_loss(model, x, target) if which == "forces" else gp_loss(model, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _params(model)


def graph_cases(rank: int, world: int) -> dict[str, Any]:
    return {
        **{r: _create_graph(rank, world, r) for r in REDUCTIONS},
        "refused": {
            "main_grad_dtype": _refused(rank, world, main_grad_dtype=torch.float64),
            "deterministic": _refused(rank, world, deterministic=world),
            "gradient_as_bucket_view": _refused(rank, world, gradient_as_bucket_view=True),
        },
        **{which: _train(rank, world, which) for which in ("penalty", "forces")},
    }


def reference_grads(reduction: str) -> list[torch.Tensor]:
    model = new()
    x = data(0)[0]
    (model(x).pow(2).sum() / GLOBAL).backward()  # what every reduction's loss adds up to
    return [p.grad for p in model.parameters()]


def reference_hv(rank: int, reduction: str) -> list[torch.Tensor]:
    """This rank's part: the derivative of its own loss's gradient, as one process takes it."""
    model = new()
    params = list(model.parameters())
    g = torch.autograd.grad(local_loss(model, share(data(0)[0], rank, WORLD), reduction), params,
                            create_graph=True)  # fmt: skip
    return list(torch.autograd.grad(sum(gi.sum() for gi in g), params))


def reference_train(which: str) -> list[torch.Tensor]:
    model = new(Energy if which == "forces" else Critic)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, target = data(step)
        opt.zero_grad()
        (force_loss(model, x, target) if which == "forces" else gp_loss(model, x)).backward()
        opt.step()
    return _params(model)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(graph_cases, WORLD, timeout_s=120)


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_create_graph_gives_the_full_batch_gradient_with_the_ranks_own_graph(
    results: list[dict[str, Any]], reduction: str
) -> None:
    for rank, res in enumerate(results):
        got = res[reduction]
        assert got["same_bits"] and got["graph"] and got["warned"], (rank, got)
        assert close(got["grads"], reference_grads(reduction)), rank
        # Not the full batch's: this rank's part, which all-reduced would be one process's.
        assert close(got["hv"], reference_hv(rank, reduction)), rank
        assert "'b.bias' got a gradient on rank" in got["second"], got["second"]
        assert "create_graph=True" in got["second"] and "torch.autograd.grad" in got["second"]


@pytest.mark.parametrize("setting", ["main_grad_dtype", "deterministic", "gradient_as_bucket_view"])
def test_a_setting_that_cannot_keep_the_graph_is_refused_on_every_rank(
    results: list[dict[str, Any]], setting: str
) -> None:
    for res in results:
        said = res["refused"][setting]
        assert said.startswith("UsageError") and setting in said, said
        assert "create_graph=True" in said and "torch.autograd.grad" in said, said


@pytest.mark.parametrize("which", ["penalty", "forces"])
def test_autograd_grad_in_the_loss_or_the_forward_trains_as_one_process(
    results: list[dict[str, Any]], which: str
) -> None:
    expected = reference_train(which)
    for res in results:
        assert close(res[which], expected)
