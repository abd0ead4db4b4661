"""torch's DDP communication hooks used wrongly, or next to collectives of the model's own:
every rank raises an error that names the hook, bucket, setting or rank at fault, within the
deadline, and a hook's collectives never pair with the model's (real gloo ranks, world 2).

One spawn runs every case in sequence (a barrier between cases, since a rank that failed
fast reaches the next case a deadline earlier than its peer); the asserts run in the parent.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import gradsync
from gradsync.testing.spawn import spawn

from toy import outcome

TIMEOUT = 3.0  # the wrapper's deadline: a rank waiting for a failed peer gives up in seconds
HOOK = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"


def wrap(model: nn.Module, **kw: Any) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(model, timeout=TIMEOUT, **kw)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def train_step(ddp: nn.Module, rank: int, step: int = 0) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    ddp(x).square().mean().backward()


# -- fix 1: the hook's collectives on gradsync's private group -----------------------------------
class AllReduceInBackward(nn.Module):
    """Its backward all-reduces an activation gradient on the default group, as a layer of
    tensor parallelism or a gathered contrastive loss does: 8x8, the size of ``b``'s grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(dist_fn.all_reduce(self.a(x))))


def race(rank: int) -> dict[str, torch.Tensor]:
    """The same training on torch DDP (the hook on the autograd thread) and on gradsync (the
    hook on a worker thread); rank 0's hook starts late, so that on one group the two threads'
    collectives would pair crosswise."""

    def late_hook(state, bucket):  # type: ignore[no-untyped-def]  (torch checks no strings)
        if rank == 0:
            time.sleep(0.05)
        return default_hooks.allreduce_hook(state, bucket)

    finals = {}
    for impl in ("torch", "gradsync"):
        model = AllReduceInBackward()
        if impl == "torch":  # one parameter per bucket on both sides
            ddp: nn.Module = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-6)
        else:
            ddp = wrap(model, bucket_cap_mb=0)
        ddp.register_comm_hook(None, late_hook)  # type: ignore[operator]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        finals[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return finals


def groups() -> dict[str, bool]:
    """Which group the hook is handed for each way of naming the wrapper's ranks."""
    out = {}
    for name, state in (("none", None), ("world", dist.group.WORLD)):
        ddp = wrap(tiny())
        ddp.register_comm_hook(state, default_hooks.allreduce_hook)
        out[name] = ddp.reducer.comm_hook.state is ddp.reducer.deadline.group
    ddp = wrap(tiny())
    powersgd = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(powersgd, psgd.powerSGD_hook)
    out["powersgd"] = powersgd.process_group is ddp.reducer.deadline.group
    return out


# -- fixes 2 and 4: a hook's result or exception on one rank -------------------------------------
def bad_hook(kind: str, rank: int) -> Any:
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        if kind == "raise" and rank == 1:
            raise ValueError("hook exploded")
        future = default_hooks.allreduce_hook(state, bucket)
        if kind == "scalar" and rank == 1:  # would be broadcast over the whole bucket
            return future.then(lambda f: f.value().sum())
        if kind == "callback" and rank == 1:
            return future.then(lambda f: f.value()[10**6])  # an IndexError in the callback
        if kind == "none":
            return future.then(lambda f: None)
        return future

    return hook


def bad_hooks(rank: int) -> dict[str, str]:
    out = {}
    for kind in ("scalar", "raise", "callback", "none"):
        ddp = wrap(tiny())
        ddp.register_comm_hook(None, bad_hook(kind, rank))
        out[kind] = outcome(lambda ddp=ddp: train_step(ddp, rank))
        dist.barrier()
    return out


# -- fixes 3, 5 and 6: registrations that must be refused ----------------------------------------
def registrations(rank: int) -> dict[str, str]:
    out = {}
    ddp = wrap(tiny())
    ddp.shard_optimizer(torch.optim.SGD, lr=0.1)
    out["after_shard"] = outcome(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))
    dist.barrier()
    powersgd = psgd.PowerSGDState(None, matrix_approximation_rank=1 + rank, start_powerSGD_iter=2)
    out["powersgd_rank"] = outcome(
        lambda: wrap(tiny()).register_comm_hook(powersgd, psgd.powerSGD_hook)
    )
    dist.barrier()
    ddp = wrap(tiny())
    if rank == 0:  # rank 1 registers nothing and goes on training
        out["one_rank"] = outcome(
            lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        )
    else:
        out["one_rank"] = outcome(lambda: train_step(ddp, rank))
    dist.barrier()
    ddp = wrap(tiny())
    if rank == 0:  # an eval forward with grad enabled: too late to register on rank 0
        ddp.eval()
        ddp(torch.randn(2, 4))
    out["late_rank0"] = outcome(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))
    return out


def cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"race": race(rank)}
    dist.barrier()
    out["groups"] = groups()
    dist.barrier()
    out["bad_hooks"] = bad_hooks(rank)
    out["registrations"] = registrations(rank)
    return out


# -- the asserts ----------------------------------------------------------------------------------
def check_race(results: list[dict[str, Any]]) -> None:
    for r in results:
        finals = r["race"]
        # The same sums in the same order as torch DDP: bit-identical.
        assert torch.equal(finals["torch"], finals["gradsync"]), finals


def check_bad_hooks(results: list[dict[str, Any]]) -> None:
    r0, r1 = results[0]["bad_hooks"], results[1]["bad_hooks"]
    assert r1["scalar"].startswith("UsageError"), r1
    assert "bad_hook.<locals>.hook on bucket 0" in r1["scalar"], r1
    assert "value has 1 elements, the bucket 10 gradient elements" in r1["scalar"], r1
    assert r1["raise"].startswith("UsageError") and "ValueError: hook exploded" in r1["raise"]
    assert r1["callback"].startswith("UsageError") and "IndexError" in r1["callback"], r1
    for kind in ("scalar", "raise", "callback"):
        # The peer waited on rank 1 and quotes its error instead of a bare lost peer.
        assert r0[kind].startswith("CollectiveTimeoutError"), r0[kind]
        assert "where it raised UsageError" in r0[kind] and "bucket 0" in r0[kind], r0[kind]
    for r in (r0, r1):
        assert r["none"].startswith("UsageError") and "value is NoneType" in r["none"], r


def check_registrations(results: list[dict[str, Any]]) -> None:
    r0, r1 = results[0]["registrations"], results[1]["registrations"]
    for r in (r0, r1):
        assert r["after_shard"].startswith("UsageError") and "shard_optimizer" in r["after_shard"]
        assert r["powersgd_rank"].startswith("UsageError"), r
        assert "matrix_approximation_rank is 1 on rank 0, 2 on rank 1" in r["powersgd_rank"], r
    assert r0["one_rank"].startswith("UsageError"), r0
    assert f"rank 0: {HOOK}; rank 1: none" in r0["one_rank"], r0
    assert r1["one_rank"].startswith("CollectiveTimeoutError"), r1
    assert "raised UsageError: gradsync: ranks registered different" in r1["one_rank"], r1
    assert r0["late_rank0"].startswith("ProtocolError"), r0
    assert r1["late_rank0"].startswith("UsageError"), r1
    assert "rank 0: none (its registration raised ProtocolError" in r1["late_rank0"], r1


@pytest.mark.timeout(150)
def test_torch_hook_misuse() -> None:
    results = spawn(cases, 2, timeout_s=120)
    check_race(results)
    for r in results:
        assert r["groups"] == {"none": True, "world": True, "powersgd": True}, r["groups"]
    check_bad_hooks(results)
    check_registrations(results)
