"""torch DDP's run-time contracts on real gloo ranks, checked against torch DDP itself.

One spawn runs every case side by side with ``torch.nn.parallel.DistributedDataParallel`` on
the same data: torch's ``Join`` with uneven inputs (both divisors), Accelerate's
``trigger_sync_in_backward`` (``reducer.prepare_for_backward`` after a ``no_sync`` forward),
``init_sync=False``, and the buffer-sync arguments of torch 2.13.
"""

from __future__ import annotations

import contextlib

import torch
from test_behaviour import count_collectives, error_text
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.testing.spawn import spawn

import toy

TOL = 2e-6


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _uneven(rank: int, world: int, wrap, how: str) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Rank r has 2 + 2r batches; the loop runs inside torch's Join (or ``model.join()``)."""
    model = toy.make_model("plain", seed=rank)
    ddp = wrap(model)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    if how == "model.join()":
        ctx = ddp.join()
    else:
        ctx = Join([ddp], divide_by_initial_world_size=how == "Join, divide by world")
    with ctx:
        for step in range(2 + 2 * rank):
            opt.zero_grad()
            toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "mean").backward()
            opt.step()
    return _params(model)


def _triggered_sync(rank: int, world: int, wrap) -> tuple[dict[str, torch.Tensor], int]:  # type: ignore[no-untyped-def]
    """Accelerate's trigger_sync_in_backward: every forward under no_sync(), and the last
    micro-batch's backward made to synchronise with ``reducer.prepare_for_backward([])``."""
    model = toy.make_model("plain", seed=rank)
    ddp = wrap(model)
    opt = toy.make_optimizer("adamw", ddp.parameters())
    reductions = 0
    for step in range(2):
        opt.zero_grad()
        for m in range(3):
            batch = toy.shard(toy.global_batch(10 * step + m), rank, world)
            with ddp.no_sync():
                loss = toy.loss_fn(ddp, batch, "mean") / 3
            last = m == 2
            with count_collectives() as counts:
                if last:
                    ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
                    ddp.reducer.prepare_for_backward([])
                loss.backward()
            reductions += counts["all_reduce"]
        opt.step()
    return _params(model), reductions


def _buffers(rank: int, world: int, wrap, **kwargs) -> list[float]:  # type: ignore[no-untyped-def]
    """Rank-specific BatchNorm statistics after construction and after one forward."""
    model = toy.make_model("bn", seed=0)
    assert model.bn is not None
    model.bn.running_mean.fill_(float(rank))
    ddp = wrap(model, **kwargs)
    seen = [model.bn.running_mean[0].item()]
    toy.loss_fn(ddp, toy.shard(toy.global_batch(0), rank, world), "mean").backward()
    return [*seen, model.bn.running_mean[0].item()]


def _drop_in(rank: int, world: int) -> dict:
    out: dict = {}
    ours, torchs = gradsync.DistributedDataParallel, TorchDDP
    for how in ("Join, divide by world", "Join, divide by active", "model.join()"):
        out[("join", how, "gradsync")] = _uneven(rank, world, ours, how)
        out[("join", how, "torch")] = _uneven(rank, world, torchs, how)
    out["triggered", "gradsync"] = _triggered_sync(rank, world, ours)
    out["triggered", "torch"] = _triggered_sync(rank, world, torchs)
    for kwargs in ({}, {"broadcast_buffers": False}, {"forward_sync_buffers": False}):
        key = ("buffers", tuple(kwargs))
        with contextlib.suppress(FutureWarning):
            out[key + ("gradsync",)] = _buffers(rank, world, ours, **kwargs)
            out[key + ("torch",)] = _buffers(rank, world, torchs, **kwargs)
    # init_sync=False: equal replicas train; unequal ones are refused on every rank.
    equal = gradsync.DistributedDataParallel(toy.make_model("plain", seed=0), init_sync=False)
    out["init_sync equal"] = equal.num_buckets > 0
    out["init_sync unequal"] = error_text(
        lambda: gradsync.DistributedDataParallel(
            toy.make_model("plain", seed=rank), init_sync=False
        )
    )
    return out


def test_torch_ddp_programs_get_torchs_results() -> None:
    per_rank = spawn(_drop_in, 2)
    for out in per_rank:
        for how in ("Join, divide by world", "Join, divide by active", "model.join()"):
            ours, theirs = out["join", how, "gradsync"], out["join", how, "torch"]
            assert toy.max_diff(ours, theirs) < TOL, how
        ours_p, ours_n = out["triggered", "gradsync"]
        theirs_p, _ = out["triggered", "torch"]
        assert toy.max_diff(ours_p, theirs_p) < TOL
        assert ours_n > 0  # the triggered backward did reduce (nothing reduces without it)
        for kwargs in ((), ("broadcast_buffers",), ("forward_sync_buffers",)):
            key = ("buffers", kwargs)
            assert out[key + ("gradsync",)] == out[key + ("torch",)], (
                kwargs,
                out[key + ("gradsync",)],
                out[key + ("torch",)],
            )
        assert out["init_sync equal"]
        assert "ReplicaMismatchError" in out["init_sync unequal"]
        assert "init_sync=False" in out["init_sync unequal"]
    # torch's default divides by the whole world while ranks have joined: the runs differ.
    a, b = (
        per_rank[0]["join", "Join, divide by world", "gradsync"],
        per_rank[0]["join", "Join, divide by active", "gradsync"],
    )
    assert toy.max_diff(a, b) > 1e-4
