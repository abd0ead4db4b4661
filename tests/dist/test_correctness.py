"""Correct by construction: exact global means for uneven data, join, and fail-fast diagnostics.

Each claim is checked with real gloo ranks against one process on the concatenated data.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from test_behaviour import count_collectives, error_text

import gradsync
from gradsync.testing.spawn import spawn

import toy

# fp32 gradients of order 1e-1: the split only changes the order of summation (a few ulps).
GRAD_TOL = 1e-6

# One global batch of 8 variable-length, padded sequences (lengths 1..6).
LENGTHS = [3, 1, 6, 2, 5, 4, 1, 6]
# The second optimizer step's data: a window with fewer sequences (a short last window).
LENGTHS_LAST = [2, 6, 3, 1]


def reference_grads(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Mean over every valid token of the batch, in one process."""
    model = toy.make_token_model()
    tokens, targets = toy.padded_batch(lengths, seed, max_len=6)
    (toy.token_loss_sum(model, tokens, targets) / (targets != -1).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _item_mean_rank(rank: int, world: int, splits: list[tuple[int, int]]) -> dict:
    """For each (micro_batch, accum) split: this rank's gradients after each optimizer step."""
    out: dict = {}
    for micro, accum in splits:
        model = toy.make_token_model()
        ddp = gradsync.DistributedDataParallel(model, reduction="item_mean", bucket_cap_mb=0)
        steps = []
        # With 8 ranks the 4-sequence window would leave ranks without data (see join tests).
        windows = ((LENGTHS, 1), (LENGTHS_LAST, 2)) if world < 8 else ((LENGTHS, 1),)
        for lengths, seed in windows:
            tokens, targets = toy.padded_batch(lengths, seed, max_len=6)
            per_rank = len(lengths) // world
            tokens = tokens[rank * per_rank : (rank + 1) * per_rank]
            targets = targets[rank * per_rank : (rank + 1) * per_rank]
            chunks = list(zip(tokens.split(micro), targets.split(micro), strict=True))
            assert len(chunks) <= accum  # the last window may hold fewer micro-batches
            model.zero_grad()
            with count_collectives() as counts:
                for i, (x, y) in enumerate(chunks):
                    last = i == len(chunks) - 1
                    with ddp.no_sync() if not last else torch.enable_grad():
                        loss = toy.token_loss_sum(ddp, x, y)
                        ddp.count_items(int((y != -1).sum()))
                        loss.backward()
            steps.append(
                {
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "all_reduce": counts["all_reduce"],
                    "num_buckets": ddp.num_buckets,
                }
            )
        out[(micro, accum)] = steps
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world, splits",
    [
        (1, [(8, 1), (4, 2)]),  # micro_batch x accum x world = 8x1x1, 4x2x1
        (2, [(2, 2), (1, 4)]),  # 2x2x2, 1x4x2
        (8, [(1, 1)]),  # 1x1x8
    ],
)
def test_item_mean_is_invariant_to_the_split(world: int, splits: list) -> None:
    per_rank = spawn(_item_mean_rank, world, (splits,), timeout_s=220)
    references = [reference_grads(LENGTHS, 1), reference_grads(LENGTHS_LAST, 2)]
    for rank, out in enumerate(per_rank):
        for split, steps in out.items():
            for step, (got, ref) in enumerate(zip(steps, references[: len(steps)], strict=True)):
                diff = toy.max_diff(got["grads"], ref)
                assert diff <= GRAD_TOL, (world, rank, split, step, diff)
                # The count exchange: one small all-reduce per optimizer step, plus the buckets'
                # (none in a world of one, which sums nothing).
                buckets = got["num_buckets"] if world > 1 else 0
                assert got["all_reduce"] == buckets + 1, (split, got["all_reduce"])


def _one_vs_hundred(rank: int, world: int) -> dict:
    model = toy.make_token_model()
    ddp = gradsync.DistributedDataParallel(model, reduction="item_mean")
    # Rank 0: one sequence with a single valid token; rank 1: four sequences, 100 valid tokens.
    lengths = [1] if rank == 0 else [25, 25, 25, 25]
    tokens, targets = toy.padded_batch(lengths, seed=10 + rank, max_len=25)
    loss = toy.token_loss_sum(ddp, tokens, targets)
    ddp.count_items(int((targets != -1).sum()))
    loss.backward()
    # Declared after the synchronising backward, the count would fall into the next window.
    late = error_text(lambda: ddp.count_items(1))
    plain = toy.make_token_model()
    plain_ddp = gradsync.DistributedDataParallel(plain)  # the usual per-rank mean, for contrast
    n = (targets != -1).sum()
    (toy.token_loss_sum(plain_ddp, tokens, targets) / n).backward()
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "mean_of_means": {n: p.grad.clone() for n, p in plain.named_parameters()},
        "late": late,
        "batch": (tokens, targets),
    }


@pytest.mark.timeout(120)
def test_one_token_rank_and_hundred_token_rank_give_the_reference() -> None:
    per_rank = spawn(_one_vs_hundred, 2)
    model = toy.make_token_model()
    (t0, y0), (t1, y1) = per_rank[0]["batch"], per_rank[1]["batch"]
    tokens = torch.cat([torch.nn.functional.pad(t0, (0, 0)), t1])
    targets = torch.cat([y0, y1])
    (toy.token_loss_sum(model, tokens, targets) / (targets != -1).sum()).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    for out in per_rank:
        assert toy.max_diff(out["grads"], reference) <= GRAD_TOL
        assert out["late"] and "between a micro-batch's forward and its backward" in out["late"]
    # Averaging per-rank means weighs the lone token like 100 tokens: visibly wrong.
    assert toy.max_diff(per_rank[0]["mean_of_means"], reference) > 1e-3


# -- uneven number of batches: join ---------------------------------------------------------
BATCHES = {0: 4, 1: 3, 2: 4}  # rank 1 runs out one batch early


def _rank_batches(rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    return [toy.shard(toy.global_batch(step), rank, world) for step in range(BATCHES[rank])]


def _join_rank(rank: int, world: int) -> dict:
    model = toy.make_model("plain", seed=rank)
    ddp = gradsync.DistributedDataParallel(model, timeout=20)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    with ddp.join(opt):
        for batch in _rank_batches(rank, world):
            opt.zero_grad()
            toy.loss_fn(ddp, batch, "mean").backward()
            opt.step()
    # Training can go on after join: one more step on every rank, all in sync.
    opt.zero_grad()
    toy.loss_fn(ddp, toy.shard(toy.global_batch(99), rank, world), "mean").backward()
    opt.step()
    ddp.check_replicas()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _join_reference(world: int) -> dict:
    """One process, each step on exactly the shards that existed at that step."""
    model = toy.make_model("plain", seed=0)
    opt = toy.make_optimizer("sgd", model.parameters())
    for step in range(max(BATCHES.values())):
        shards = [
            toy.shard(toy.global_batch(step), r, world) for r in range(world) if step < BATCHES[r]
        ]
        batch = tuple(torch.cat(ts) for ts in zip(*shards, strict=True))
        opt.zero_grad()
        toy.loss_fn(model, batch, "mean").backward()
        opt.step()
    opt.zero_grad()
    toy.loss_fn(model, toy.global_batch(99), "mean").backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_join_trains_on_exactly_the_data_that_existed() -> None:
    world = 3
    per_rank = spawn(_join_rank, world)
    reference = _join_reference(world)
    for rank, params in enumerate(per_rank):
        # Every rank, the one that joined early too, after one more step past the join; SGD
        # momentum carries the joined steps, so rank 1's optimizer state must have followed.
        assert toy.max_diff(params, reference) <= 2e-6, rank


def _foreign_collective(rank: int, world: int) -> dict:
    model = toy.make_model("plain", seed=0)
    ddp = gradsync.DistributedDataParallel(model, timeout=3)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    t0 = time.monotonic()
    err = None
    try:
        with ddp.join(opt):
            for batch in _rank_batches(rank, world):
                opt.zero_grad()
                loss = toy.loss_fn(ddp, batch, "mean")
                loss.backward()
                opt.step()
                dist.all_reduce(loss.detach())  # outside the protocol: rank 1 misses the last
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    return {"error": err, "seconds": time.monotonic() - t0}


@pytest.mark.timeout(120)
def test_collective_outside_join_is_an_error_not_a_hang() -> None:
    out = spawn(_foreign_collective, 3, pg_timeout_s=8, return_failures=True)
    joined = out[1]
    assert joined["error"] and "CollectiveTimeoutError" in joined["error"], joined
    assert "ran out of data" in joined["error"]
    assert joined["seconds"] < 3 + 10
    for rank in (0, 2):  # stuck in the foreign all_reduce: they fail too, within seconds
        failed = isinstance(out[rank], gradsync.testing.spawn.RankFailure) or out[rank]["error"]
        assert failed, out[rank]


# -- diagnostics ----------------------------------------------------------------------------
def _diagnostics(rank: int, world: int) -> dict:
    out: dict = {}
    # Replicas that drift: rank 2 nudges one parameter outside the synchronised step.
    ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0), check_replicas_every=1)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    batch = toy.shard(toy.global_batch(0), rank, world)
    toy.loss_fn(ddp, batch, "mean").backward()
    opt.step()
    if rank == 2:
        with torch.no_grad():
            ddp.module.body.bias[0] += 1e-7
    out["drift"] = error_text(lambda: toy.loss_fn(ddp, batch, "mean").backward())
    # NaN gradients on rank 1 only: every rank raises before the update, naming rank 1.
    model = toy.make_model("plain", 0)
    ddp = gradsync.DistributedDataParallel(model, check_finite=True, bucket_cap_mb=0)
    opt = toy.make_optimizer("sgd", ddp.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def nan_step() -> None:
        loss = toy.loss_fn(ddp, batch, "mean")
        if rank == 1:
            loss = loss * float("nan")
        loss.backward()
        opt.step()

    out["nan"] = error_text(nan_step)
    opt.zero_grad()
    out["unchanged_after_nan"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    # any_rank: all ranks agree to skip a step one rank wants to skip.
    loss = toy.loss_fn(ddp, batch, "mean")
    if rank == 1:
        loss = loss * float("inf")
    skipped = gradsync.any_rank(not torch.isfinite(loss).item())
    if not skipped:
        loss.backward()
        opt.step()
    out["skipped"] = skipped
    out["unchanged_after_skip"] = all(
        torch.equal(before[n], p) for n, p in model.named_parameters()
    )
    # The same first batch on every rank: a warning on every rank; sharded data: none.
    for name, first in (("same", toy.global_batch(0)[:2]), ("sharded", batch[:2])):
        ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp(*first)
        out[name] = [str(w.message) for w in caught if "identical first batch" in str(w.message)]
    return out


@pytest.mark.timeout(120)
def test_diagnostics_fail_on_every_rank() -> None:
    per_rank = spawn(_diagnostics, 3)
    for out in per_rank:
        assert out["drift"].startswith("ReplicaMismatchError"), out["drift"]
        assert "'body.bias'" in out["drift"] and "rank(s) [2]" in out["drift"]
        assert out["nan"].startswith("NonFiniteGradientError"), out["nan"]
        assert (
            "rank 1: [" in out["nan"] and "(bucket" in out["nan"] and "rank 0: [" not in out["nan"]
        )
        assert out["unchanged_after_nan"] and out["skipped"] and out["unchanged_after_skip"]
        assert out["same"] and not out["sharded"]


def _late_rank(rank: int, world: int, deadline: float) -> dict:
    ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=deadline)
    batch = toy.shard(toy.global_batch(0), rank, world)
    loss = toy.loss_fn(ddp, batch, "mean")
    if rank == 1:
        time.sleep(2 * deadline)  # stuck in rank-specific work
    t0 = time.monotonic()
    err = error_text(loss.backward)
    return {"error": err, "waited": time.monotonic() - t0}


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_arrive_fails_the_others_within_the_deadline() -> None:
    deadline = 2.0
    out = spawn(_late_rank, 2, (deadline,), pg_timeout_s=60, return_failures=True)
    assert out[0]["error"] and out[0]["error"].startswith("CollectiveTimeoutError"), out[0]
    assert "all-reduce of bucket 0 (step 0)" in out[0]["error"]
    assert out[0]["waited"] < deadline + 10  # not torch's 30-minute default
