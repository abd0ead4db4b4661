"""torch DDP's run-time contracts on real gloo ranks, checked against torch DDP itself.

One spawn runs every case side by side with ``torch.nn.parallel.DistributedDataParallel`` on
the same data: torch's ``Join`` with uneven inputs (both divisors), Accelerate's
``trigger_sync_in_backward`` (``reducer.prepare_for_backward`` after a ``no_sync`` forward),
``init_sync=False``, the buffer-sync arguments of torch 2.13, ``require_backward_grad_sync``
changed while the module's forward runs (Lightning's manual optimization), and the bucket plan:
the same parameters in each bucket as torch's rebuilt buckets.
"""

from __future__ import annotations

import contextlib

import torch
from test_behaviour import count_collectives, error_text
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
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


class _StepInside(nn.Module):
    """A module whose forward may run the backward itself, as Lightning's manual optimization
    does (``manual_backward`` inside ``training_step``, inside the wrapper's forward), under
    ``no_sync()`` on all but a step's last micro-batch, or only enter and leave ``no_sync()``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.ddp: nn.Module | None = None  # the wrapper, for its no_sync()
        self.inside = ""  # "backward": backward inside the forward; "enter": no_sync only

    def forward(self, batch: tuple[torch.Tensor, ...], scale: float, sync: bool) -> torch.Tensor:
        assert self.ddp is not None
        loss = toy.loss_fn(self.net, batch, "mean") * scale
        with contextlib.nullcontext() if sync else self.ddp.no_sync():  # type: ignore[operator]
            if self.inside == "backward":
                loss.backward()
        return loss


def _flag_inside_forward(rank: int, world: int, inside: str) -> tuple[dict, int]:
    """Steps of 3 micro-batches. ``inside="backward"``: each runs its backward inside the
    forward, under no_sync() but the last (a plain loop on rank 1, the other idiom: the two
    must agree). ``"enter"``: the forward enters and leaves no_sync() and every backward runs
    after it: torch decides when the forward returns, so every micro-batch synchronises."""
    model = _StepInside(toy.make_model("plain", seed=0))
    ddp = gradsync.DistributedDataParallel(model)
    model.ddp = ddp
    model.inside = inside if rank == 0 or inside == "enter" else ""
    opt = toy.make_optimizer("adamw", ddp.parameters())
    for step in range(2):
        for m in range(3):
            batch = toy.shard(toy.global_batch(10 * step + m), rank, world)
            last = m == 2
            if model.inside == "backward":
                ddp(batch, 1 / 3, last)
            elif model.inside == "enter":
                ddp(batch, 1 / 3, False).backward()
            else:
                with contextlib.nullcontext() if last else ddp.no_sync():
                    ddp(batch, 1 / 3, True).backward()
            if last or inside == "enter":
                opt.step()
                opt.zero_grad()
    return _params(model.net), ddp.reducer.num_reductions


def _outside_reference(rank: int, world: int, every: bool) -> dict:
    """torch DDP on the plain loop: no_sync() on the first two of 3 micro-batches, or never
    (``every``: a step per micro-batch)."""
    model = toy.make_model("plain", seed=0)
    ddp = TorchDDP(model)
    opt = toy.make_optimizer("adamw", ddp.parameters())
    for step in range(2):
        for m in range(3):
            sync = m == 2 or every
            with contextlib.nullcontext() if sync else ddp.no_sync():
                batch = toy.shard(toy.global_batch(10 * step + m), rank, world)
                (toy.loss_fn(ddp, batch, "mean") / 3).backward()
            if sync:
                opt.step()
                opt.zero_grad()
    return _params(model)


def _buffers(rank: int, world: int, wrap, **kwargs) -> list[float]:  # type: ignore[no-untyped-def]
    """Rank-specific BatchNorm statistics after construction and after one forward."""
    model = toy.make_model("bn", seed=0)
    assert model.bn is not None
    model.bn.running_mean.fill_(float(rank))
    ddp = wrap(model, **kwargs)
    seen = [model.bn.running_mean[0].item()]
    toy.loss_fn(ddp, toy.shard(toy.global_batch(0), rank, world), "mean").backward()
    return [*seen, model.bn.running_mean[0].item()]


def _buckets(cfg: GPTConfig, **kwargs) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    """The parameters of each bucket: torch DDP's after its rebuild (gradients in the order
    they became ready), and gradsync's plan for the same model and arguments."""
    torch.manual_seed(0)
    theirs = TorchDDP(GPT(cfg), **kwargs)
    ours = gradsync.DistributedDataParallel(GPT(cfg), **kwargs)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    for _ in range(2):
        lm_loss(theirs(x), x).backward()
    theirs(x)  # torch rebuilds its buckets at the forward after its first backward
    rebuilt = theirs._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    torchs = [sorted(int(i) for i in b.split()) for b in rebuilt.split(",")]
    return torchs, [sorted(spec.param_indices) for spec in ours.bucket_specs]


def _drop_in(rank: int, world: int) -> dict:
    out: dict = {}
    # The bench's GPT (50.7 MB of gradients) at the default caps, and a tiny one at a small cap.
    out["buckets", "default"] = _buckets(GPTConfig(64, 16, n_layer=4, n_head=8, n_embd=512))
    tiny = GPTConfig(64, 16, n_layer=2, n_head=2, n_embd=32)
    out["buckets", "cap 0.002"] = _buckets(tiny, bucket_cap_mb=0.002)
    ours, torchs = gradsync.DistributedDataParallel, TorchDDP
    for how in ("Join, divide by world", "Join, divide by active", "model.join()"):
        out[("join", how, "gradsync")] = _uneven(rank, world, ours, how)
        out[("join", how, "torch")] = _uneven(rank, world, torchs, how)
    out["triggered", "gradsync"] = _triggered_sync(rank, world, ours)
    out["triggered", "torch"] = _triggered_sync(rank, world, torchs)
    for inside in ("backward", "enter"):
        out["inside", inside, "gradsync"] = _flag_inside_forward(rank, world, inside)
        out["inside", inside, "torch"] = _outside_reference(rank, world, inside == "enter")
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
        for key in (("buckets", "default"), ("buckets", "cap 0.002")):
            torchs, ours = out[key]
            assert ours == torchs and len(ours) > 2, (key, torchs, ours)
        for how in ("Join, divide by world", "Join, divide by active", "model.join()"):
            ours, theirs = out["join", how, "gradsync"], out["join", how, "torch"]
            assert toy.max_diff(ours, theirs) < TOL, how
        ours_p, ours_n = out["triggered", "gradsync"]
        theirs_p, _ = out["triggered", "torch"]
        assert toy.max_diff(ours_p, theirs_p) < TOL
        assert ours_n > 0  # the triggered backward did reduce (nothing reduces without it)
        for inside, reductions in (("backward", 2), ("enter", 6)):
            params, n = out["inside", inside, "gradsync"]
            assert n == reductions, (inside, n)  # one per step, or one per micro-batch
            assert toy.max_diff(params, out["inside", inside, "torch"]) < TOL, inside
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
