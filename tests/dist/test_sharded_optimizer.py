"""ShardedOptimizer on real gloo ranks equals the unsharded optimizer.

Two references: (1) the same torch optimizer, unsharded, stepped in each rank on the same
synchronised gradients: the sharded step must equal it *bit for bit* (an elementwise optimizer
does the same arithmetic on a slice as on the whole parameter); (2) one process trained on the
concatenated global batch, equal within fp32 reduction-order noise. One spawn per world size,
a grid of cases inside; the world-4 run also writes the DCP checkpoint the others reload.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.testing.spawn import spawn

STEPS = 20
HALF = 10  # checkpoints are taken after HALF steps and training continues to STEPS
GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4
MAX_NORM = 0.05  # well below the gradient norms of the toy problem (~0.3-1): clipping bites


class Odd(nn.Module):
    """67 trainable elements (35 + 7 + 21 + 3 + 1, prime): no world size divides a bucket, and a
    0-dim parameter. A frozen layer must be left out of the optimizer and untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(torch.tanh(self.a(x))) * self.scale)


def make_model() -> Odd:
    torch.manual_seed(0)
    return Odd()


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def groups(model: Odd, kind: str) -> list[dict[str, Any]]:
    """Two param groups with different hyper-parameters (the second decays slower)."""
    if kind == "adamw":
        second = {"lr": 5e-3, "weight_decay": 0.1}
    else:
        second = {"lr": 0.05}
    return [
        {"params": [model.a.weight, model.a.bias, model.frozen.weight]},
        {"params": [model.b.weight, model.b.bias, model.scale], **second},
    ]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}

# name: (optimizer, align, explicit buckets?, clip?, scheduler?, gradient path)
CASES = {
    "adamw": ("adamw", 1, False, False, False, "grad"),
    "adamw_align16": ("adamw", 16, False, False, False, "grad"),
    "sgd_buckets": ("sgd", 4, True, False, False, "grad"),
    "adamw_clip": ("adamw", 1, False, True, False, "grad"),
    "sgd_steplr": ("sgd", 1, False, False, True, "grad"),
    "adamw_reduce_scatter": ("adamw", 2, True, False, False, "shards"),
}


def explicit_buckets(model: Odd) -> list[list[nn.Parameter]]:
    # The order a DDP wrapper would hand in: reverse registration order, two buckets.
    return [[model.scale, model.b.bias, model.b.weight], [model.a.bias, model.a.weight]]


def reference(case: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, the unsharded torch optimizer."""
    kind, _, _, clip, sched, _ = CASES[case]
    model = make_model()
    cls, defaults = OPTIMIZERS[kind]
    opt = cls(groups(model, kind), **defaults)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if sched else None
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reduce_scatter_shards(opt: gradsync.ShardedOptimizer, world: int) -> list[torch.Tensor]:
    """What a DDP wrapper would do instead of average_gradients: reduce-scatter each padded
    flat gradient bucket, divided by the world size."""
    shards = []
    for b in opt.buckets:
        flat = torch.zeros_like(b.data)
        for p, off in zip(b.params, b.layout.offsets, strict=True):
            flat[off : off + p.numel()] = p.grad.reshape(-1) / world
        out = torch.empty_like(b.shard)
        dist.reduce_scatter_single(out, flat)
        shards.append(out)
    return shards


def _step(case: str, rank: int, world: int, model: Odd, opt: Any, scheduler: Any) -> None:
    _, _, _, clip, _, path = CASES[case]
    if path == "shards":
        shards = _reduce_scatter_shards(opt, world)
        opt.step_from_shards(shards)
        handles = opt.all_gather_params(async_op=True)
        for i in reversed(range(len(handles))):  # waited per bucket, in any order
            handles[i].wait() if handles[i] is not None else None
        return
    gradsync.average_gradients(model)
    if clip:
        opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    if scheduler is not None:
        scheduler.step()


def _train_case(case: str, rank: int, world: int) -> dict[str, Any]:
    kind, align, explicit, clip, sched, path = CASES[case]
    model = make_model()
    frozen_before = model.frozen.weight.clone()
    cls, defaults = OPTIMIZERS[kind]
    buckets = explicit_buckets(model) if explicit else None
    opt = gradsync.ShardedOptimizer(
        groups(model, kind), cls, align=align, buckets=buckets, **defaults
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if sched else None
    # The unsharded optimizer on the same synchronised gradients: the bit-exact reference.
    twin = copy.deepcopy(model)
    twin_opt = cls(groups(twin, kind), **defaults)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_opt, 3, 0.5) if sched else None
    bitwise = True
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank, world)
        F.mse_loss(model(x), y).backward()
        grads_before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        _step(case, rank, world, model, opt, scheduler)
        if path == "grad":  # the twin steps on the same synchronised (and clipped) gradients
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                q.grad = None if p.grad is None else p.grad.clone()
            twin_opt.step()
            if twin_sched is not None:
                twin_sched.step()
            bitwise &= all(
                torch.equal(p, q)
                for p, q in zip(model.parameters(), twin.parameters(), strict=True)
            )
        del grads_before
    state_elems = sum(
        v.numel() for st in opt.optim.state.values() for k, v in st.items() if k != "step"
    )
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bitwise_twin": bitwise,
        "state_elements": state_elems,
        "bucket_numels": [b.layout.numel for b in opt.buckets],
        "frozen_untouched": torch.equal(frozen_before, model.frozen.weight),
        "frozen_in_optimizer": any(p is model.frozen.weight for b in opt.buckets for p in b.params),
        "lr": [g["lr"] for g in opt.param_groups],
        "inner_lr": [g["lr"] for g in opt.optim.param_groups],
    }


def _train_adamw(
    model: Odd, opt: Any, rank: int, world: int, steps: range, sync: bool = True
) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank, world)
        F.mse_loss(model(x), y).backward()
        if sync:
            gradsync.average_gradients(model)
        opt.step()


def _sharded_adamw(model: Odd) -> gradsync.ShardedOptimizer:
    cls, defaults = OPTIMIZERS["adamw"]
    return gradsync.ShardedOptimizer(groups(model, "adamw"), cls, align=1, **defaults)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _consolidated(rank: int, world: int) -> dict[str, Any]:
    """Sharded for HALF steps, consolidated on the last rank, continued by plain AdamW there."""
    model = make_model()
    opt = _sharded_adamw(model)
    _train_adamw(model, opt, rank, world, range(HALF))
    to = world - 1
    opt.consolidate_state_dict(to=to)
    if rank != to:
        with pytest.raises(gradsync.UsageError, match="consolidate_state_dict"):
            opt.state_dict()
        return {}
    full = opt.state_dict()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(groups(plain_model, "adamw"), **OPTIMIZERS["adamw"][1])
    plain.load_state_dict(full)
    _train_adamw(plain_model, plain, 0, 1, range(HALF, STEPS), sync=False)
    return {"params": _params(plain_model)}


def _full_load(rank: int, world: int) -> dict[str, Any]:
    """An unsharded AdamW's state dict after HALF steps, loaded into a ShardedOptimizer."""
    plain_model = make_model()
    plain = torch.optim.AdamW(groups(plain_model, "adamw"), **OPTIMIZERS["adamw"][1])
    _train_adamw(plain_model, plain, 0, 1, range(HALF), sync=False)
    model = copy.deepcopy(plain_model)
    opt = _sharded_adamw(model)
    opt.load_state_dict(plain.state_dict())
    _train_adamw(model, opt, rank, world, range(HALF, STEPS))
    return {"params": _params(model)}


def _dcp_save(rank: int, world: int, path: str) -> dict[str, Any]:
    model = make_model()
    opt = _sharded_adamw(model)
    _train_adamw(model, opt, rank, world, range(HALF))
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    _train_adamw(model, opt, rank, world, range(HALF, STEPS))  # saving changed nothing
    return {"params": _params(model)}


def _dcp_load(rank: int, world: int, path: str) -> dict[str, Any]:
    model = make_model()
    model.a.weight.data.fill_(7.0)  # not the saved weights: the load must bring them
    opt = _sharded_adamw(model)
    state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
    _train_adamw(model, opt, rank, world, range(HALF, STEPS))
    return {"params": _params(model)}


def _bad_input(rank: int, world: int) -> dict[str, str]:
    """Every rank must raise, naming the problem, instead of hanging or training wrongly."""
    out = {}
    params = list(make_model().parameters())
    if rank == world - 1:
        params = params[1:]  # one rank forgot a (trainable) parameter
    try:
        gradsync.ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)
    except gradsync.UsageError as exc:
        out["different_params"] = str(exc)
    model = make_model()
    opt = gradsync.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model.a.weight.data = model.a.weight.data.clone()  # cuts the link to the flat buffer
    F.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    try:
        opt.step()
    except gradsync.ProtocolError as exc:
        out["replaced_data"] = str(exc)
    return out


def _clip_function(rank: int, world: int) -> dict[str, Any]:
    """gradsync.clip_grad_norm_ on disjoint pieces of gradients equals torch's on the whole."""
    g = torch.Generator().manual_seed(5)
    whole = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    out = {}
    for norm_type in (2.0, 1.0, float("inf")):
        mine = []
        for t in whole:
            piece = t.reshape(-1).chunk(world)  # uneven chunks; some ranks may get none
            if rank < len(piece):
                p = nn.Parameter(torch.zeros_like(piece[rank]))
                p.grad = piece[rank].clone()
                mine.append(p)
        total = gradsync.clip_grad_norm_(mine, 0.5, norm_type, process_group=dist.group.WORLD)
        out[norm_type] = (total, [p.grad for p in mine])
    return out


def _clip_dtensors(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DTensor gradients (one sharded over the mesh, one replicated): each counted once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    a, b = _dtensor_grads()
    pa, pb = nn.Parameter(torch.zeros_like(a)), nn.Parameter(torch.zeros_like(b))
    pa.grad = distribute_tensor(a, mesh, [Shard(0)])
    pb.grad = distribute_tensor(b, mesh, [Replicate()])
    total = gradsync.clip_grad_norm_([pa, pb], 0.5)
    return total, pa.grad.full_tensor(), pb.grad.full_tensor()


def _dtensor_grads() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 3, generator=g), torch.randn(5, generator=g)


def _run(rank: int, world: int, path: str, save: bool) -> dict[str, Any]:
    results: dict[str, Any] = {c: _train_case(c, rank, world) for c in CASES}
    results["consolidated"] = _consolidated(rank, world)
    results["full_load"] = _full_load(rank, world)
    results["dcp"] = _dcp_save(rank, world, path) if save else _dcp_load(rank, world, path)
    results["clip_function"] = _clip_function(rank, world)
    results["clip_dtensor"] = _clip_dtensors(world)
    if world > 1:
        results["bad_input"] = _bad_input(rank, world)
    return results


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# The N-rank runs average per-rank mean gradients where the reference takes one mean over the
# batch, so gradients differ by a few fp32 ulps (~1e-7 relative) each step; SGD with momentum
# and AdamW carry that forward over 20 steps on order-1 weights. Observed differences are below
# 1e-6; 1e-5 leaves room, and is far below what a wrong slice or a skipped step would cause
# (1e-3 and more). With one rank the gradients are the same computation: exactly equal.
TOL = 1e-5


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    """The world-4 run: its results, and the DCP checkpoint it writes after HALF steps."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return spawn(_run, 4, (path, True), timeout_s=200), path


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.timeout(240)
def test_sharded_optimizer_equals_unsharded(world: int, world4: tuple[list, str]) -> None:
    per_rank, path = world4
    if world != 4:  # the others reload the world-4 checkpoint: 4 -> 1, 2, 3
        per_rank = spawn(_run, world, (path, False), timeout_s=200)
    refs = {case: reference(case) for case in CASES}
    total = sum(p.numel() for p in make_model().parameters() if p.requires_grad)
    counts: dict[str, list[int]] = {}
    for case, (_, align, *_rest) in CASES.items():
        for rank, results in enumerate(per_rank):
            r = results[case]
            where = f"world={world} rank={rank} {case}"
            assert r["bitwise_twin"] or CASES[case][-1] == "shards", f"{where}: not bit-exact"
            # One rank: the same gradients, so exact, except that the clipping norm is summed
            # in another order than torch's (fp64 partial sums): a last-ulp difference.
            tol = 0.0 if world == 1 and "clip" not in case else TOL
            diff = max_diff(r["params"], refs[case])
            assert diff <= tol, f"{where}: differs from one process by {diff:.3g}"
            # Replicas hold identical parameters: exactly.
            assert max_diff(r["params"], per_rank[0][case]["params"]) == 0.0, where
            assert r["frozen_untouched"] and not r["frozen_in_optimizer"], where
            assert r["inner_lr"] == r["lr"], f"{where}: scheduler lr not passed on"
        # Optimizer state per rank: 1/d of the unsharded state within one alignment unit per
        # bucket, and each element held by exactly one rank (AdamW: 2 tensors, SGD: 1).
        states = 2 if CASES[case][0] == "adamw" else 1
        mine = [results[case]["state_elements"] for results in per_rank]
        buckets = per_rank[0][case]["bucket_numels"]
        counts[case] = mine
        assert sum(mine) == states * total, f"{case}: {mine}"
        bound = states * sum(n / world + align for n in buckets)
        assert max(mine) < bound, f"world={world} {case}: per-rank state {mine} > {bound}"
    print(f"\nworld={world} per-rank optimizer state elements (unsharded AdamW 134, SGD 67):")
    for case, mine in counts.items():
        print(f"  {case}: {mine}")
    _check_state_dicts(world, per_rank, 0.0 if world == 1 else TOL)
    _check_clip_function(world, per_rank)
    if world > 1:
        for rank, results in enumerate(per_rank):
            bad = results["bad_input"]
            assert "different parameters" in bad.get("different_params", ""), (rank, bad)
            assert "no longer lives" in bad.get("replaced_data", ""), (rank, bad)


def _check_state_dicts(world: int, per_rank: list[dict[str, Any]], tol: float) -> None:
    uninterrupted = reference("adamw")
    consolidated = per_rank[world - 1]["consolidated"]["params"]
    # The plain AdamW continued on one process: the first half's gradients were N-rank ones.
    assert max_diff(consolidated, uninterrupted) <= tol, "consolidated state dict"
    for rank, results in enumerate(per_rank):
        diff = max_diff(results["full_load"]["params"], uninterrupted)
        assert diff <= tol, f"world={world} rank={rank} full_load: {diff:.3g}"
        # The first half ran on 4 ranks whatever world loads it: never exact, TOL.
        diff = max_diff(results["dcp"]["params"], uninterrupted)
        assert diff <= TOL, f"world={world} rank={rank} dcp: {diff:.3g}"


def _check_clip_function(world: int, per_rank: list[dict[str, Any]]) -> None:
    params = [nn.Parameter(torch.zeros_like(t)) for t in _dtensor_grads()]
    for p, t in zip(params, _dtensor_grads(), strict=True):
        p.grad = t
    expected_dt = torch.nn.utils.clip_grad_norm_(params, 0.5)
    for rank, results in enumerate(per_rank):
        total, ga, gb = results["clip_dtensor"]
        # Per-shard norms combined in another order than torch's: a few ulps.
        assert abs(total.item() - expected_dt.item()) <= 1e-6 * expected_dt.item(), rank
        assert torch.allclose(ga, params[0].grad, rtol=1e-6, atol=0), rank
        assert torch.allclose(gb, params[1].grad, rtol=1e-6, atol=0), rank
    g = torch.Generator().manual_seed(5)
    whole = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    for norm_type in (2.0, 1.0, float("inf")):
        params = [nn.Parameter(torch.zeros_like(t)) for t in whole]
        for p, t in zip(params, whole, strict=True):
            p.grad = t.clone()
        expected = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
        clipped = torch.cat([p.grad.reshape(-1) for p in params])
        for rank, results in enumerate(per_rank):
            total, grads = results["clip_function"][norm_type]
            # Summation order differs (per rank, then across ranks): a few fp32 ulps of ~10.
            assert abs(total.item() - expected.item()) <= 1e-5 * expected.item(), (rank, norm_type)
            n = 0
            for t, grad in zip(whole, grads, strict=False):
                pieces = t.reshape(-1).chunk(world)
                start = sum(x.numel() for x in pieces[:rank])
                want = clipped[n + start : n + start + grad.numel()]
                assert torch.allclose(grad, want, rtol=1e-5, atol=0), (rank, norm_type)
                n += t.numel()
