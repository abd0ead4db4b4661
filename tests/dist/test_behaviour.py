"""Behaviour of DistributedDataParallel beyond plain equivalence, on real gloo ranks.

Each test spawns once and runs several checks inside; a check that must fail on every rank
returns each rank's error text, so the test sees what every rank raised.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.testing.spawn import spawn

import toy

# See test_equivalence.py: fp32, order-1 parameters, a few ulps of reduction-order difference.
TOL = 2e-6


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count calls of the collectives gradsync may issue, by patching torch.distributed."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather")}

    def counting(name):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in originals:
            stack.enter_context(mock.patch.object(dist, name, counting(name)))
        yield counts


def error_text(fn) -> str | None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as exc:  # the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return None


def _accumulated(rank: int, world: int, cap: float, flag: bool) -> dict:
    """Three optimizer steps of 4 micro-batches each, accumulated under ``no_sync()`` or, as
    nanoGPT does (``flag``), by setting ``require_backward_grad_sync`` on every micro-step:
    either equals one step on the 4x larger concatenated batch."""
    micro = 4
    model = toy.make_model("plain", seed=rank)
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=cap)
    opt = toy.make_optimizer("adamw", ddp.parameters())
    per_step = []
    for step in range(3):
        opt.zero_grad()
        batches = [toy.global_batch(step * micro + m) for m in range(micro)]
        with count_collectives() as counts:
            for m, batch in enumerate(batches):
                last = m == micro - 1
                if flag:
                    ddp.require_backward_grad_sync = last
                ctx = ddp.no_sync() if not (flag or last) else contextlib.nullcontext()
                with ctx:
                    loss = toy.loss_fn(ddp, toy.shard(batch, rank, world), "mean") / micro
                    loss.backward()
        per_step.append(dict(counts))
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "counts": per_step,
        "num_buckets": ddp.num_buckets,
    }


def _accumulation_and_counts(rank: int, world: int) -> dict:
    out: dict = {}
    for cap in (0, 25.0):
        out[("no_sync", cap)] = _accumulated(rank, world, cap, flag=False)
        out[("require_backward_grad_sync", cap)] = _accumulated(rank, world, cap, flag=True)
    # Sum reduction with a sum loss.
    model = toy.make_model("plain", seed=rank)
    ddp = gradsync.DistributedDataParallel(model, reduction="sum", bucket_cap_mb=300 / 2**20)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    for step in range(10):
        opt.zero_grad()
        toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "sum").backward()
        opt.step()
    out["sum"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # gradient_as_bucket_view: .grad lives inside the bucket buffer, and results do not change.
    model = toy.make_model("plain", seed=rank)
    ddp = gradsync.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    views = []
    for step in range(10):
        opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of clearing must work
        toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "mean").backward()
        buf = ddp.reducer.buckets[0].buffer
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        views.append(
            all(lo <= p.grad.data_ptr() < hi for p in model.parameters() if p.requires_grad)
        )
        opt.step()
    out["bucket_view"] = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "all_views": all(views),
    }
    return out


def _reference_accumulated(steps: int, micro: int) -> dict:
    model = toy.make_model("plain", seed=0)
    opt = toy.make_optimizer("adamw", model.parameters())
    for step in range(steps):
        opt.zero_grad()
        batches = [toy.global_batch(step * micro + m) for m in range(micro)]
        big = tuple(torch.cat(ts) for ts in zip(*batches, strict=True))
        toy.loss_fn(model, big, "mean").backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference_sum(steps: int) -> dict:
    model = toy.make_model("plain", seed=0)
    opt = toy.make_optimizer("sgd", model.parameters())
    for step in range(steps):
        opt.zero_grad()
        toy.loss_fn(model, toy.global_batch(step), "sum").backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(120)
def test_accumulation_sum_and_bucket_views(world: int) -> None:
    per_rank = spawn(_accumulation_and_counts, world)
    ref_accum = _reference_accumulated(3, 4)
    ref_sum = _reference_sum(10)
    ref_plain = toy.train_reference("plain", "sgd", 10, world)
    for rank, out in enumerate(per_rank):
        for key in [
            (how, cap) for how in ("no_sync", "require_backward_grad_sync") for cap in (0, 25.0)
        ]:
            r = out[key]
            assert toy.max_diff(r["params"], ref_accum) <= TOL, (rank, key)
            # Exactly one all-reduce per bucket per optimizer step, however many micro-batches.
            for counts in r["counts"]:
                assert counts.get("all_reduce", 0) == r["num_buckets"], (key, counts)
                assert counts.get("broadcast", 0) == 0  # the toy model has no buffers
        # Sums of 24 per-sample gradients are ~24x larger than means; same relative error.
        assert toy.max_diff(out["sum"], ref_sum) <= 24 * TOL, rank
        assert out["bucket_view"]["all_views"], rank
        plain = {n: ref_plain[n] for n in out["bucket_view"]["params"]}
        assert toy.max_diff(out["bucket_view"]["params"], plain) <= TOL, rank


def _errors(rank: int, world: int) -> dict:
    out: dict = {}
    # 1. A model that differs on one rank raises on every rank, naming the parameter and ranks.
    torch.manual_seed(0)
    model = toy.Net()
    if rank == world - 1:
        model.extra = torch.nn.Linear(2, 2)
    out["extra_layer"] = error_text(lambda: gradsync.DistributedDataParallel(model))
    model = toy.Net()
    if rank == 1:
        model.body = torch.nn.Linear(toy.DIM, toy.DIM, bias=False)
    out["missing_bias"] = error_text(lambda: gradsync.DistributedDataParallel(model))
    out["setting"] = error_text(
        lambda: gradsync.DistributedDataParallel(toy.Net(), bucket_cap_mb=1.0 + rank)
    )
    # A setting only rank 1 gets wrong is refused on every rank, quoting rank 1's reason
    # (not a wait for rank 1 until the deadline), and so is first_bucket_cap_mb=nan anywhere.
    bad = {"bucket_cap_mb": -1.0} if rank == 1 else {}
    out["bad_on_one"] = error_text(lambda: gradsync.DistributedDataParallel(toy.Net(), **bad))
    bad = {"compression": "bfloat16"} if rank == 1 else {}
    out["bad_compression"] = error_text(lambda: gradsync.DistributedDataParallel(toy.Net(), **bad))
    out["first_nan"] = error_text(
        lambda: gradsync.DistributedDataParallel(toy.Net(), first_bucket_cap_mb=float("nan"))
    )
    # A parameter frozen on one rank after wrapping: shard_optimizer() refuses on every rank.
    model = toy.Net()
    ddp = gradsync.DistributedDataParallel(model)
    if rank == 1:
        model.body.weight.requires_grad_(False)
    out["shard_changed"] = error_text(lambda: ddp.shard_optimizer(torch.optim.SGD, lr=0.1))
    # 2. Unused on every rank, find_unused_parameters=False: the same step raises everywhere.
    ddp = gradsync.DistributedDataParallel(toy.make_model("unused", 0))
    batch = toy.shard(toy.global_batch(0), rank, world)
    out["unused_all"] = error_text(lambda: toy.loss_fn(ddp, batch, "mean").backward())
    # 3. Used on some ranks only (routing): rank 0 never runs branch_b. Raises everywhere.
    ddp = gradsync.DistributedDataParallel(toy.make_model("routed", 0))
    out["unused_some"] = error_text(lambda: toy.loss_fn(ddp, batch, "mean").backward())
    # After the error the wrapper is usable again (its state was reset), with the flag on.
    ddp = gradsync.DistributedDataParallel(toy.make_model("routed", 0), find_unused_parameters=True)
    toy.loss_fn(ddp, batch, "mean").backward()
    grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None}
    # 4. finish_gradient_synchronization() is idempotent: a second call changes nothing.
    ddp.finish_gradient_synchronization()
    out["idempotent"] = all(
        torch.equal(grads[n], p.grad) for n, p in ddp.module.named_parameters() if n in grads
    )
    # 5. A backward whose forward bypassed the wrapper would never be synchronised: error.
    out["bypass"] = error_text(lambda: toy.loss_fn(ddp.module, batch, "mean").backward())
    return out


@pytest.mark.timeout(120)
def test_errors_are_raised_on_every_rank() -> None:
    world = 3
    per_rank = spawn(_errors, world)
    for out in per_rank:
        assert out["extra_layer"] and out["extra_layer"].startswith("ModelMismatchError"), out
        assert "'extra.weight'" in out["extra_layer"] and f"rank {world - 1}" in out["extra_layer"]
        assert "'body.bias'" in out["missing_bias"] and "rank 1" in out["missing_bias"], out
        assert "'bucket_cap_mb'" in out["setting"] and "rank 1" in out["setting"], out
        assert out["bad_on_one"].startswith("UsageError"), out
        assert "rank 1: bucket_cap_mb must be" in out["bad_on_one"], out
        assert "rank 1: compression must be" in out["bad_compression"], out
        assert (
            "rank 0: first_bucket_cap_mb must be a number >= 0 (math.inf: one bucket) or None, "
            "got nan" in (out["first_nan"])
        ), out
        assert out["shard_changed"].startswith("ParametersChangedError"), out
        assert """  rank 1: ["'body.weight' requires_grad True -> False"]""" in out["shard_changed"]
        assert out["unused_all"].startswith("UnusedParametersError"), out
        for r in range(world):  # unused everywhere: every rank is named with the parameter
            assert f"rank {r}: ['unused.weight', 'unused.bias']" in out["unused_all"]
        assert out["unused_some"].startswith("UnusedParametersError"), out
        # With 24 samples on 3 ranks, rank 0 takes only branch A and rank 2 only branch B.
        assert "rank 0: ['branch_b.weight', 'branch_b.bias']" in out["unused_some"]
        assert "rank 2: ['branch_a.weight', 'branch_a.bias']" in out["unused_some"]
        assert "rank 1: ['" not in out["unused_some"]  # rank 1 takes both branches
        assert out["idempotent"]
        assert out["bypass"] and "no forward ran through" in out["bypass"], out


def _buffers_and_eval(rank: int, world: int) -> dict:
    out: dict = {}
    torch.manual_seed(rank)
    model = toy.Net(bn=True)
    ddp = gradsync.DistributedDataParallel(model)
    batch = toy.shard(toy.global_batch(0), rank, world)
    # Eval and no_grad forwards on rank 0 only: no collective may be issued, or this hangs.
    with count_collectives() as counts:
        if rank == 0:
            ddp.eval()
            with torch.no_grad():
                for _ in range(100):
                    ddp(batch[0])
            for _ in range(10):  # eval mode with grad enabled: still no collective
                ddp(batch[0])
            ddp.train()
            with torch.no_grad():
                ddp(batch[0])
    out["eval_counts"] = dict(counts)
    dist.barrier()
    # A training forward broadcasts rank 0's buffers first (before this rank's update).
    ddp.module.bn.running_mean.fill_(float(rank))
    with count_collectives() as counts:
        toy.loss_fn(ddp, batch, "mean").backward()
    out["train_counts"] = dict(counts)
    m = ddp.module
    with torch.no_grad():
        h = torch.tanh(m.body(m.frozen(m.embed(batch[0]).mean(1))))
    # Started from rank 0's 0.0, not this rank's own value, then took this rank's batch mean.
    out["running_mean_error"] = (m.bn.running_mean - m.bn.momentum * h.mean(0)).abs().max().item()
    # Checkpoint keys are the plain module's; loading takes plain and prefixed dicts.
    state = ddp.state_dict()
    out["keys_match"] = list(state) == list(ddp.module.state_dict())
    prefixed = {f"module.{k}": v.clone() + 1 for k, v in state.items()}
    ddp.load_state_dict(prefixed)
    out["prefixed_loaded"] = torch.equal(ddp.module.body.weight, prefixed["module.body.weight"])
    ddp.load_state_dict(state)
    out["plain_loaded"] = torch.equal(ddp.module.body.weight, state["body.weight"])
    return out


@pytest.mark.timeout(120)
def test_buffers_eval_and_state_dict() -> None:
    per_rank = spawn(_buffers_and_eval, 2)
    for rank, out in enumerate(per_rank):
        assert out["eval_counts"] == {}, (rank, out["eval_counts"])
        assert out["train_counts"].get("broadcast", 0) == 2  # float buffers + int64 counter
        assert out["keys_match"] and out["prefixed_loaded"] and out["plain_loaded"]
        # Without the broadcast rank 1 would be off by (1 - momentum) * 1.0 = 0.9.
        assert out["running_mean_error"] < 1e-6, (rank, out["running_mean_error"])


def _default_caps(rank: int, world: int) -> dict:
    """The default cap with the ranks where they are (one host), then with ranks 0 and 1 on
    one host and rank 2 on another ([Note: the default bucket cap])."""
    from gradsync.comm import hosts

    # 16.25 MiB of fp32 gradients: "scaled" is 2.03 MiB, torch's cap 25.
    model = torch.nn.Sequential(
        *[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)], torch.nn.Linear(1024, 64)
    )
    out = {"one host": gradsync.DistributedDataParallel(model).bucket_cap_mb}
    with mock.patch.object(hosts, "host_key", lambda: "a" if rank < 2 else "b"):
        two = gradsync.DistributedDataParallel(model)
        out["two hosts"] = (two.bucket_cap_mb, len(two.bucket_specs))
        out["25 asked for"] = gradsync.DistributedDataParallel(
            model, bucket_cap_mb=25
        ).bucket_cap_mb
    return out


@pytest.mark.timeout(120)
def test_the_default_cap_is_torchs_on_one_host_and_scaled_across_hosts() -> None:
    for rank, out in enumerate(spawn(_default_caps, 3)):
        assert out["one host"] == 25.0, (rank, out)
        assert out["two hosts"][0] == pytest.approx(2.0313, abs=1e-4), (rank, out)
        assert out["two hosts"][1] == 4 and out["25 asked for"] == 25.0, (rank, out)
