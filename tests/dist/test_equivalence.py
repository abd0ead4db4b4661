"""N-rank training with gradsync equals 1-process training on the concatenated batch."""

from __future__ import annotations

import pytest
import torch

import gradsync
import gradsync.comm
from gradsync.testing.spawn import spawn

import toy

STEPS = 10
SMALL_CAP_MB = 300 / 2**20  # 300 bytes: buckets of 1-2 parameters in the toy models
CAPS = (0, SMALL_CAP_MB, "scaled", None)  # "scaled" (the default): 1 MiB for these toys
CASES = [
    (kind, opt, cap, find_unused, "native")
    for kind, find_unused in (("plain", False), ("bn", False), ("routed_unused", True))
    for opt in ("sgd", "adamw")
    for cap in CAPS
] + [
    # gradsync's own all-reduce algorithms, every bucket through them.
    ("plain", "sgd", SMALL_CAP_MB, False, "ring"),
    ("routed_unused", "adamw", 0, True, "ring"),
    ("plain", "adamw", SMALL_CAP_MB, False, "hierarchical"),
    ("bn", "sgd", 25.0, False, "hierarchical"),
]


def make_algorithm(name: str, world: int) -> str | gradsync.comm.AllReduceAlgorithm:
    if name == "hierarchical" and world % 2 == 0:  # two "nodes" of world/2 ranks
        return gradsync.comm.HierarchicalAllReduce(local_world_size=world // 2)
    return name


# fp32 parameters of order 1 after 10 steps. The N-rank run sums per-rank partial gradients where
# the reference sums over the whole batch in one matmul, so each gradient differs by a few ulps
# (~1e-7 relative); SGD with momentum and AdamW carry such differences forward over 10 steps
# without amplifying them much. BatchNorm on 6-sample per-rank batches divides by a small
# batch standard deviation, which amplifies rounding: observed up to ~5e-5, so it gets 2e-4.
TOL = {"plain": 2e-6, "routed_unused": 2e-6, "bn": 2e-4}


def _train(rank: int, world: int) -> dict:
    results = {}
    for kind, opt_name, cap, find_unused, algorithm in CASES:
        # Each rank starts from different weights: the wrapper must broadcast rank 0's.
        model = toy.make_model(kind, seed=rank)
        frozen_before = model.frozen.weight.clone()
        ddp = gradsync.DistributedDataParallel(
            model,
            bucket_cap_mb=cap,
            find_unused_parameters=find_unused,
            algorithm=make_algorithm(algorithm, world),
        )
        opt = toy.make_optimizer(opt_name, ddp.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            loss = toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "mean")
            loss.backward()
            opt.step()
        unused_grad = model.unused.weight.grad if model.unused is not None else None
        results[(kind, opt_name, cap, algorithm)] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "num_buckets": ddp.num_buckets,
            "num_trainable": sum(p.requires_grad for p in model.parameters()),
            "frozen_changed": not torch.equal(
                model.frozen.weight, toy.make_model(kind, 0).frozen.weight
            ),
            "frozen_was_broadcast": rank == 0
            or not torch.equal(frozen_before, model.frozen.weight),
            "unused_grad_is_none": unused_grad is None,
        }
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.timeout(240)
def test_training_equals_single_process(world: int) -> None:
    per_rank = spawn(_train, world, timeout_s=220)
    references = {
        (kind, opt_name): toy.train_reference(kind, opt_name, STEPS, world)
        for kind, opt_name, _, _, _ in CASES
    }
    for rank, results in enumerate(per_rank):
        for (kind, opt_name, cap, algorithm), r in results.items():
            case = f"world={world} rank={rank} {kind} {opt_name} bucket_cap_mb={cap} {algorithm}"
            reference = references[(kind, opt_name)]
            diff = toy.max_diff(r["params"], {n: reference[n] for n in r["params"]})
            assert diff <= TOL[kind], f"{case}: max parameter difference {diff:.3g}"
            # Buffers follow rank 0 (broadcast before each forward); after the last forward
            # other ranks hold their own batch's update, as in torch DDP: rank 0 is the truth.
            if rank == 0:
                buffer_diff = toy.max_diff(r["buffers"], {n: reference[n] for n in r["buffers"]})
                assert buffer_diff <= TOL[kind], f"{case}: buffers differ by {buffer_diff:.3g}"
            assert not r["frozen_changed"], f"{case}: frozen parameter changed"
            assert r["frozen_was_broadcast"], f"{case}: frozen parameter not broadcast from rank 0"
            if kind == "routed_unused":
                # Unused on every rank: .grad stays None, as in single-process training.
                assert r["unused_grad_is_none"], case
            if cap == 0:
                assert r["num_buckets"] == r["num_trainable"], case
            if cap == SMALL_CAP_MB:
                assert 2 <= r["num_buckets"] < r["num_trainable"] or kind == "plain", case
            if cap is None or cap == "scaled":
                # After the first step the unused parameters get a bucket of their own, so
                # that the used ones launch during backward (unused_last.py).
                assert r["num_buckets"] == (2 if kind == "routed_unused" else 1), case
