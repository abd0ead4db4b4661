"""Fail fast, on every rank, naming the culprit: mistakes in the training loop and faults of a rank.

Each case runs on real gloo ranks inside one spawn per group of cases (spawning costs seconds,
the cases milliseconds). Every case builds its own wrapper; cases that end in a timeout use a
deadline of seconds, and ranks meet at a barrier on the default group between cases so that a
late rank of one case cannot leak into the next.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_behaviour import error_text

import gradsync
from gradsync.testing.spawn import spawn

import toy

WORLD = 3
CULPRIT = 2  # the rank that misbehaves in every case


def _step(ddp: gradsync.DistributedDataParallel, rank: int, world: int, step: int = 0) -> None:
    toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "mean").backward()


def _wrap(**kwargs) -> gradsync.DistributedDataParallel:  # type: ignore[no-untyped-def]
    return gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=20, **kwargs)


def _desync_cases(rank: int, world: int, out: dict) -> None:
    # An extra training forward (its backward skipped, e.g. on a NaN loss) on one rank.
    ddp = _wrap()

    def extra_forward() -> None:
        if rank == CULPRIT:
            toy.loss_fn(ddp, toy.shard(toy.global_batch(0), rank, world), "mean")
        _step(ddp, rank, world)

    out["skipped_backward"] = error_text(extra_forward)
    dist.barrier()
    # One micro-batch under no_sync() on one rank, synchronised on the others.
    ddp = _wrap()

    def no_sync_on_one_rank() -> None:
        if rank == CULPRIT:
            with ddp.no_sync():
                _step(ddp, rank, world, 1)
        _step(ddp, rank, world)

    out["no_sync_on_one_rank"] = error_text(no_sync_on_one_rank)
    dist.barrier()


def _parameter_cases(rank: int, world: int, out: dict) -> None:
    # requires_grad turned on after wrapping: that parameter would train on local gradients.
    ddp = _wrap()
    ddp.module.frozen.weight.requires_grad_(True)
    out["unfrozen"] = error_text(lambda: _step(ddp, rank, world))
    dist.barrier()
    # Frozen after wrapping: named as a change, not as an unused parameter.
    ddp = _wrap()
    ddp.module.body.requires_grad_(False)
    out["frozen"] = error_text(lambda: _step(ddp, rank, world))
    dist.barrier()
    # A submodule replaced after wrapping (never broadcast, never reduced), even when unused
    # parameters are allowed (where it used to pass silently).
    ddp = _wrap(find_unused_parameters=True)
    torch.manual_seed(rank)  # a different replacement on every rank
    ddp.module.body = torch.nn.Linear(toy.DIM, toy.DIM)
    out["replaced"] = error_text(lambda: _step(ddp, rank, world))
    dist.barrier()
    # Re-wrapping after the change is the fix: it trains, and the old wrapper says it is retired.
    old = ddp
    ddp = gradsync.DistributedDataParallel(old.module, timeout=20)
    out["rewrapped"] = error_text(lambda: _step(ddp, rank, world))
    out["old_wrapper"] = error_text(lambda: _step(old, rank, world))
    out["wrapper_of_wrapper"] = error_text(lambda: gradsync.DistributedDataParallel(ddp))
    dist.barrier()


def _update_and_item_cases(rank: int, world: int, out: dict) -> None:
    # One extra optimizer.step() on one rank: caught at the next step, not only by an opt-in check.
    ddp = _wrap()
    opt = toy.make_optimizer("sgd", ddp.parameters())
    _step(ddp, rank, world)
    opt.step()
    if rank == CULPRIT:
        opt.step()
    opt.zero_grad()
    out["extra_step"] = error_text(lambda: _step(ddp, rank, world, 1))
    dist.barrier()
    # item_mean: a rank that forgets count_items() would make every gradient 1.5x the mean.
    net = toy.make_token_model()
    ddp = gradsync.DistributedDataParallel(net, reduction="item_mean", timeout=20)
    tokens, targets = toy.padded_batch([3, 1, 6, 2, 5, 4], seed=0)
    n = len(tokens) // world

    def forgotten_count() -> None:
        mine = slice(rank * n, (rank + 1) * n)
        loss = toy.token_loss_sum(ddp, tokens[mine], targets[mine])
        if rank != CULPRIT:
            ddp.count_items(int((targets[mine] != -1).sum()))
        loss.backward()

    out["forgotten_count"] = error_text(forgotten_count)
    dist.barrier()
    # Not a desync: with item_mean, ranks may run different numbers of micro-batches per step
    # (rank r runs r + 1 here); the result is still the global mean over items.
    ddp = gradsync.DistributedDataParallel(toy.make_token_model(), reduction="item_mean")
    mine = list(range(rank * (rank + 1) // 2, (rank + 1) * (rank + 2) // 2))  # 0 | 1 2 | 3 4 5
    for i, seq in enumerate(mine):
        with ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext():
            loss = toy.token_loss_sum(ddp, tokens[seq : seq + 1], targets[seq : seq + 1])
            count = (targets[seq] != -1).sum()  # a tensor, as a GPU loop has it; or a number
            ddp.count_items(count if i % 2 == 0 else int(count))
            loss.backward()
    reference = toy.make_token_model()
    (toy.token_loss_sum(reference, tokens, targets) / int((targets != -1).sum())).backward()
    out["uneven_micro_batches"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(ddp.module.parameters(), reference.parameters(), strict=True)
    )
    dist.barrier()
    bad = {}
    for value in (math.nan, math.inf, -1.0):
        loss = toy.token_loss_sum(ddp, tokens[:1], targets[:1])
        bad[str(value)] = error_text(lambda v=value: ddp.count_items(v))
        ddp.count_items(1)
        loss.backward()
    out["bad_counts"] = bad

    def bad_tensor_count() -> None:  # checked in the step's total, so on every rank
        loss = toy.token_loss_sum(ddp, tokens[:1], targets[:1])
        ddp.count_items(torch.tensor(-7.0 if rank == CULPRIT else 1.0))
        loss.backward()

    out["bad_tensor_count"] = error_text(bad_tensor_count)
    out["bad_timeouts"] = {
        repr(t): error_text(lambda t=t: _wrap_with_timeout(t))
        for t in (0, -1.0, math.inf, math.nan, timedelta(0), timedelta(seconds=-1), "5")
    }
    dist.barrier()


def _wrap_with_timeout(timeout: object) -> None:
    gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=timeout)  # type: ignore[arg-type]


def _join_cases(rank: int, world: int, out: dict) -> None:
    # join() with a frozen submodule, and with a wrapped module that has nothing to train (a
    # frozen feature extractor): uneven data (rank r has r + 1 batches) must end cleanly.
    results = {}
    model = toy.make_model("plain", 0)
    model.body.requires_grad_(False)
    ddp = gradsync.DistributedDataParallel(model, timeout=20)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def uneven() -> None:
        with ddp.join(opt):
            for step in range(rank + 1):
                opt.zero_grad()
                _step(ddp, rank, world, step)
                opt.step()
        ddp.check_replicas()

    results["frozen_submodule"] = error_text(uneven)
    dist.barrier()
    torch.manual_seed(0)
    extractor = gradsync.DistributedDataParallel(
        torch.nn.Linear(toy.DIM, toy.DIM).requires_grad_(False), timeout=20
    )
    head = torch.nn.Linear(toy.DIM, 1)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)

    def uneven_extractor() -> None:
        with extractor.join(head_opt):
            for _ in range(rank + 1):
                head(extractor(torch.randn(4, toy.DIM))).sum().backward()

    results["nothing_to_train"] = error_text(uneven_extractor)
    dist.barrier()
    out["join"] = results


def _mistakes(rank: int, world: int) -> dict:
    out: dict = {}
    _join_cases(rank, world, out)
    _desync_cases(rank, world, out)
    _parameter_cases(rank, world, out)
    _update_and_item_cases(rank, world, out)
    return out


@pytest.fixture(scope="module")
def mistakes() -> list[dict]:
    return spawn(_mistakes, WORLD, timeout_s=240)


def _assert_every_rank(results: list[dict], key: str, error: str, *needles: str) -> None:
    for rank, out in enumerate(results):
        text = out[key]
        assert text is not None and text.startswith(error), (rank, key, text)
        for needle in needles:
            assert needle in text, (rank, key, needle, text)


@pytest.mark.timeout(300)
def test_desynchronised_steps_raise_at_the_step_naming_the_rank(mistakes: list[dict]) -> None:
    _assert_every_rank(
        mistakes, "skipped_backward", "DesyncError", f"rank(s) [{CULPRIT}]", "2 training forwards"
    )
    _assert_every_rank(
        mistakes,
        "no_sync_on_one_rank",
        "DesyncError",
        f"rank(s) [{CULPRIT}]",
        "(1 under no_sync())",
    )


@pytest.mark.timeout(300)
def test_parameter_changes_after_wrapping_are_named_on_every_rank(mistakes: list[dict]) -> None:
    _assert_every_rank(
        mistakes,
        "unfrozen",
        "ParametersChangedError",
        "'frozen.weight' requires_grad False -> True",
    )
    _assert_every_rank(
        mistakes, "frozen", "ParametersChangedError", "'body.weight' requires_grad True -> False"
    )
    _assert_every_rank(
        mistakes, "replaced", "ParametersChangedError", "'body.weight' was replaced", "wrap again"
    )
    for rank, out in enumerate(mistakes):
        assert out["rewrapped"] is None, (rank, out["rewrapped"])
        assert out["old_wrapper"] and "wrapped again at" in out["old_wrapper"], out
        assert out["wrapper_of_wrapper"].startswith("UsageError"), out["wrapper_of_wrapper"]


@pytest.mark.timeout(300)
def test_extra_optimizer_step_and_item_counts(mistakes: list[dict]) -> None:
    _assert_every_rank(
        mistakes, "extra_step", "ReplicaMismatchError", f"rank(s) [{CULPRIT}]", "optimizer.step()"
    )
    _assert_every_rank(
        mistakes, "forgotten_count", "ProtocolError", f"rank(s) [{CULPRIT}]", "count_items()"
    )
    for out in mistakes:
        # fp32 sums of a few dozen order-1 terms in another order: a few ulps.
        assert out["uneven_micro_batches"] < 1e-6, out["uneven_micro_batches"]
        for value, text in out["bad_counts"].items():
            assert text and text.startswith("UsageError") and "finite count" in text, value
        text = out["bad_tensor_count"]
        assert text and text.startswith("UsageError") and "negative or non-finite" in text, text
        for timeout, text in out["bad_timeouts"].items():
            assert text and text.startswith("UsageError") and "timeout" in text, timeout


@pytest.mark.timeout(300)
def test_join_with_frozen_parameters_ends_cleanly(mistakes: list[dict]) -> None:
    for rank, out in enumerate(mistakes):
        assert out["join"] == {"frozen_submodule": None, "nothing_to_train": None}, (rank, out)


# -- faults: ranks that are late, stuck or misbehave, under a deadline of seconds ---------------
DEADLINE = 2.0


def _timed(fn) -> tuple[str | None, float]:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    err = error_text(fn)
    return err, time.monotonic() - t0


def _faults(rank: int, world: int) -> dict:
    out: dict = {}
    dist.barrier()  # start together: importing torch may skew the ranks by seconds under load
    # Construction: a rank that never gets there (here: late by 3 deadlines).
    if rank == CULPRIT:
        time.sleep(3 * DEADLINE)
    out["construction"] = _timed(
        lambda: gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=DEADLINE)
    )
    dist.barrier()
    # A rank stuck in rank-specific work at the first forward (the data check waits for it).
    ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=DEADLINE)
    if rank == CULPRIT:
        time.sleep(3 * DEADLINE)
    out["first_forward"] = _timed(lambda: _step(ddp, rank, world))
    # Retrying after the timeout must not pair stale collectives with new ones: refused.
    out["retry"] = error_text(lambda: _step(ddp, rank, world, 1))
    dist.barrier()
    # A rank that runs backward twice raises; its peers' timeout says where it was last seen.
    ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=DEADLINE)
    _step(ddp, rank, world)

    def backward_twice() -> None:
        loss = toy.loss_fn(ddp, toy.shard(toy.global_batch(1), rank, world), "mean")
        loss.backward(retain_graph=True)
        if rank == CULPRIT:
            loss.backward()
        _step(ddp, rank, world, 2)

    out["backward_twice"] = _timed(backward_twice)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def faults() -> list[dict]:
    return spawn(_faults, WORLD, timeout_s=240)


@pytest.mark.timeout(300)
def test_a_missing_rank_is_named_within_the_deadline(faults: list[dict]) -> None:
    for rank, out in enumerate(faults):
        if rank == CULPRIT:
            continue
        for key in ("construction", "first_forward"):
            text, waited = out[key]
            assert text and text.startswith("CollectiveTimeoutError"), (rank, key, text)
            assert f"rank {CULPRIT}: " in text, (rank, key, text)
            assert waited < DEADLINE + 5, (rank, key, waited)
        assert "never seen" in out["construction"][0] or "last seen" in out["construction"][0]
        assert "last seen" in out["first_forward"][0], out["first_forward"][0]
    # The late rank's own collective fails too: it must never pair with the one the others
    # abandoned (that would hand it a sum of unrelated tensors without any error).
    late_text, _ = faults[CULPRIT]["first_forward"]
    assert late_text and late_text.startswith("CollectiveTimeoutError"), late_text
    for rank, out in enumerate(faults):
        # Every rank, the late one included, refuses further collectives on that wrapper.
        assert out["retry"] and "issues no more collectives" in out["retry"], (rank, out["retry"])


@pytest.mark.timeout(300)
def test_peers_of_a_rank_that_raised_say_what_it_raised(faults: list[dict]) -> None:
    culprit_text, _ = faults[CULPRIT]["backward_twice"]
    assert culprit_text and culprit_text.startswith("ProtocolError"), culprit_text
    for rank, out in enumerate(faults):
        if rank == CULPRIT:
            continue
        text, waited = out["backward_twice"]
        assert text and text.startswith("CollectiveTimeoutError"), (rank, text)
        assert f"rank {CULPRIT}: last seen" in text and "raised ProtocolError" in text, text
        assert waited < DEADLINE + 5, (rank, waited)
