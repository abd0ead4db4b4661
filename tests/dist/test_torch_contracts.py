"""torch's contracts kept under gradsync's features: what a training loop written for torch's
DDP does means what it means there, with ``shard_optimizer()`` (ZeRO-1), compression and a
device mesh switched on.

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips by the global norm;
- ``opt.zero_grad()`` / ``model.zero_grad()`` after backward clears what the step would apply;
- ``model.module.state_dict()`` and ``model.module.parameters()`` right after ``opt.step()``
  hold the stepped weights on every rank;
- a ``.grad`` kept from one step keeps its values through the next steps, though gradsync
  hands the bucket's buffer over to the gradients rather than copying out of it;
- optimizer hyper-parameters (and which parameters have a ``.grad``) are compared across ranks
  at every sharded step: a difference raises ``UsageError`` on every rank, naming it.

One 2-rank gloo spawn runs every case; each is compared with one process training on the
concatenated batch in float64 (MasterWeights' cases are in ``test_master_misuse.py``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from test_master_misuse import _clear

import gradsync
from gradsync.comm import PowerSGD
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.mesh_run import Layout
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
WORLD, BATCH, STEPS = 2, 8, 4
DTYPE = torch.float64
SGD = {"lr": 0.5, "momentum": 0.9}
CLIP = 0.05  # the gradients' norm is 0.3-0.6: every step is clipped, by 6x or more
# Per step, what the loop does after backward: "opt" opt.zero_grad(), "model" the wrapper's
# zero_grad(), "zeros" opt.zero_grad(set_to_none=False) (a zero gradient: momentum still moves).
CLEARS = {1: "opt", 2: "model", 3: "zeros"}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mesh_run.random_batches(CFG, BATCH, STEPS, seed=300)


def reference(
    clip: float = 0.0, clears: dict[int, str] | None = None, momentum: float = 0.9
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """One process on the whole batch, torch's SGD: the parameters after each step, and the
    norm torch's clip_grad_norm_ returned at each step."""
    torch.manual_seed(0)
    model = GPT(CFG).to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=momentum)
    after, norms = [], []
    for step, (tokens, targets) in enumerate(batches()):
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        _clear(opt, model, (clears or {}).get(step))
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after, norms


def _wrap(mesh: Any, **options: Any) -> gradsync.DistributedDataParallel:
    model = mesh_run.make_model(CFG, mesh, seed=0, dtype=DTYPE)
    return gradsync.DistributedDataParallel(
        model, device_mesh=mesh_run.data_parallel_mesh(mesh), timeout=30, **options
    )


def _train(
    ddp: gradsync.DistributedDataParallel,
    opt: Any,
    mesh: Any,
    *,
    clip: str = "",
    clears: dict[int, str] | None = None,
    slow_rank: int | None = None,
    kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """``STEPS`` steps; returns per step the module's state read right after ``opt.step()``
    (``state_dict()`` and ``parameters()``, as a checkpoint or an EMA reads them) and the norm
    the clipping returned. ``slow_rank`` reaches each step 0.2 s late, so that a parameter
    all-gather still in flight on the others would show in what they read. ``kept`` gets
    every ``.grad`` after each backward, with a copy of its values."""
    rank = torch.distributed.get_rank()
    state, params, norms = [], [], []
    names = [n for n, _ in ddp.module.named_parameters()]
    for step, batch in enumerate(batches()):
        tokens, targets = mesh_run.rank_part(batch, mesh)
        opt.zero_grad()
        lm_loss(ddp(tokens), targets).backward()
        if kept is not None:
            kept += [(p.grad, p.grad.clone()) for p in ddp.parameters() if p.grad is not None]
        _clear(opt, ddp, (clears or {}).get(step))
        if clip == "torch":
            norms.append(float(_full(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP))))
        elif clip == "gradsync":
            norms.append(float(gradsync.clip_grad_norm_(ddp.parameters(), CLIP)))
        if rank == slow_rank:
            time.sleep(0.2)
        opt.step()
        state.append({k: _full(v).clone() for k, v in ddp.module.state_dict().items()})
        params.append(
            {n: _full(p).clone() for n, p in zip(names, ddp.module.parameters(), strict=True)}
        )
    return {"state": state, "params": params, "norms": norms}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the type and message are what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _sharded(mesh: Any, lr: float = SGD["lr"]) -> tuple[Any, Any]:
    ddp = _wrap(mesh)
    return ddp, ddp.shard_optimizer(torch.optim.SGD, lr=lr, momentum=SGD["momentum"])


def _misuse(mesh: Any, rank: int) -> dict[str, Any]:
    """Steps the ranks would take differently: refused on every rank, nothing stepped."""
    out: dict[str, Any] = {}
    # A learning rate that differs on one rank, from the first step on.
    ddp, opt = _sharded(mesh, lr=0.5 if rank == 0 else 0.25)
    out["lr at step 1"] = _error(lambda: _train(ddp, opt, mesh))
    # A scheduler stepped on rank 0 only, after the second step: refused at the third.
    ddp, opt = _sharded(mesh)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tokens, targets = mesh_run.rank_part(batches()[0], mesh)
    for step in range(3):
        opt.zero_grad()
        lm_loss(ddp(tokens), targets).backward()
        if step < 2:
            opt.step()
            if rank == 0 and step == 1:
                sched.step()
        else:
            before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
            out["scheduler on rank 0"] = _error(opt.step)
            out["unchanged"] = all(
                torch.equal(p, before[n]) for n, p in ddp.module.named_parameters()
            )
    # zero_grad() after backward on rank 1 only.
    ddp, opt = _sharded(mesh)
    opt.zero_grad()
    lm_loss(ddp(tokens), targets).backward()
    if rank == 1:
        opt.zero_grad()
    out["zero_grad on rank 1"] = _error(opt.step)
    return out


def _run(rank: int, world: int) -> dict[str, Any]:
    dp = Layout(dp=WORLD).build_mesh()
    out: dict[str, Any] = {}
    out["sharded, torch clip"] = _train(*_sharded(dp), dp, clip="torch")
    out["sharded, zero_grad"] = _train(*_sharded(dp), dp, clears=CLEARS)
    out["sharded, read after step"] = _train(*_sharded(dp), dp, slow_rank=1)
    out["misuse"] = _misuse(dp, rank)
    ddp, kept = _wrap(dp), []
    out["kept grads"] = _train(ddp, torch.optim.SGD(ddp.parameters(), **SGD), dp, kept=kept)
    out["kept grads"]["changed"] = sum(not torch.equal(g, values) for g, values in kept)
    out["kept grads"]["kept"] = len(kept)
    # Compression: torch's clip on the reduced (bf16-summed, or low-rank) .grad.
    for name, compression in (("bf16", "bf16"), ("powersgd", PowerSGD(rank=1))):
        ddp = _wrap(dp, compression=compression)
        opt = torch.optim.SGD(ddp.parameters(), lr=SGD["lr"])
        out[name] = _train(ddp, opt, dp, clip="torch")
        out[name]["grads"] = [p.grad.clone() for p in ddp.parameters()]
    # A mesh whose data-parallel ranks split each sequence (cp): plain gradients.
    cp = Layout(dp=1, cp=WORLD).build_mesh()
    ddp = _wrap(cp)
    out["cp mesh"] = _train(ddp, torch.optim.SGD(ddp.parameters(), **SGD), cp, clip="torch")
    # Tensor-parallel DTensor parameters next to plain ones: torch's clip refuses the mix
    # (torch's own error, the same without gradsync); gradsync.clip_grad_norm_ takes it.
    tp = Layout(dp=1, tp=WORLD).build_mesh()
    ddp = _wrap(tp)
    opt = torch.optim.SGD(ddp.parameters(), **SGD)
    out["tp mesh, torch clip"] = _error(lambda: _train(ddp, opt, tp, clip="torch"))
    ddp = _wrap(tp)
    out["tp mesh"] = _train(ddp, torch.optim.SGD(ddp.parameters(), **SGD), tp, clip="gradsync")
    return out


# float64: a reduction summed in another order than one process's differs by ~1e-16 per step;
# a skipped clip, a cleared gradient applied or a stale parameter moves values by > 1e-3.
TOL = 1e-12


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _check_steps(case: str, got: dict[str, Any], want: list[dict[str, torch.Tensor]]) -> None:
    for step, expected in enumerate(want):
        for what in ("state", "params"):
            diff = _diff(got[what][step], expected)
            assert diff < TOL, f"{case}: {what} after step {step} off by {diff:.3g}"


@pytest.mark.timeout(240)
def test_torch_idioms_keep_their_meaning() -> None:
    results = spawn(_run, WORLD, timeout_s=220)
    clipped, norms = reference(clip=CLIP)
    cleared, _ = reference(clears=CLEARS)
    plain, _ = reference()
    clipped_sgd, norms_sgd = reference(clip=CLIP, momentum=0.0)  # the compression cases'
    assert min(norms) > 6 * CLIP, norms  # the clipping bites at every step
    for rank, r in enumerate(results):
        # ZeRO-1: torch's clip sees the reduced .grad, with the global norm.
        _check_steps("sharded, torch clip", r["sharded, torch clip"], clipped)
        got = r["sharded, torch clip"]["norms"]
        assert max(abs(a - b) for a, b in zip(got, norms, strict=True)) < 1e-12, (got, norms)
        # zero_grad() after backward clears what the step applies, as for torch.
        _check_steps("sharded, zero_grad", r["sharded, zero_grad"], cleared)
        # Gradients kept from earlier steps: nothing wrote into them since.
        got = r["kept grads"]
        _check_steps("kept grads", got, plain)
        assert got["kept"] == STEPS * len(plain[0]) and got["changed"] == 0, got
        # Read right after opt.step(), while the other rank is still on its way: stepped.
        _check_steps("sharded, read after step", r["sharded, read after step"], plain)
        misuse = r["misuse"]
        text = misuse["lr at step 1"]
        assert text.startswith("UsageError: gradsync: ShardedOptimizer.step()"), text
        assert "param group 0's 'lr' is 0.5 on rank 0 and 0.25 on rank 1" in text, text
        text = misuse["scheduler on rank 0"]
        assert "param group 0's 'lr' is 0.25 on rank 0 and 0.5 on rank 1" in text, text
        assert "must run on every rank" in text and misuse["unchanged"], text
        text = misuse["zero_grad on rank 1"]
        assert text.startswith("UsageError") and "zero_grad()" in text, text
        named = "'tok_emb.weight' (param group 0, shape [13, 8]) has a .grad on rank 0 and none"
        assert named in text, text
        # Compression: torch's clip on a .grad that is the same on every rank.
        for name in ("bf16", "powersgd"):
            got, other = r[name], results[1 - rank][name]
            assert got["norms"] == other["norms"], (name, got["norms"], other["norms"])
            assert all(torch.equal(a, b) for a, b in zip(got["grads"], other["grads"], strict=True))
            assert all(n > 4 * CLIP for n in got["norms"]), (name, got["norms"])
        # bf16 sums are within ~2**-8 of the exact ones: the clipped run stays within 2e-3 of
        # one process after 4 steps (measured 1e-4), an unclipped one would be ~0.1 off.
        diff = _diff(r["bf16"]["params"][-1], clipped_sgd[-1])
        assert diff < 2e-3, diff
        got = r["bf16"]["norms"]
        assert max(abs(a / b - 1) for a, b in zip(got, norms_sgd, strict=True)) < 0.05, got
        # A cp mesh: plain gradients, torch's clip as one process's.
        _check_steps("cp mesh", r["cp mesh"], clipped)
        # Tensor parallelism: torch refuses the mix loudly; gradsync's clip is one process's.
        text = r["tp mesh, torch clip"]
        assert text.startswith("RuntimeError") and "mixed torch.Tensor and DTensor" in text, text
        _check_steps("tp mesh", r["tp mesh"], clipped)
