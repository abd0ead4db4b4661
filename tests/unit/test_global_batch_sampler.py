"""GlobalBatchSampler without a process group: every rank's sampler built in this process with
``num_replicas`` and ``rank``, and the step layout checked against an order drawn here."""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import gradsync
from gradsync.data import DistributedSampler, GlobalBatchSampler, sample_generator, sample_seed
from gradsync.errors import CheckpointError, UsageError

# Uneven shares warn at construction (checked once below); the layout tests build many.
pytestmark = pytest.mark.filterwarnings("ignore:global batches of")

SEED = 5
# (dataset length, global batch, micro batch): N in 1..4 does not always divide the global
# batch, the last global batch is short (of fewer samples than ranks for 23 / 7 and 10 / 4),
# micro_batch_size=1 leaves shares with fewer samples than the step's count, and a dataset
# smaller than one global batch is a single short step.
CASES = [(26, 7, 2), (24, 8, 3), (23, 7, 2), (10, 4, 1), (30, 12, 5), (5, 8, 2)]
WORLDS = [1, 2, 3, 4]


def sampler(n: int, g: int, m: int, world: int, rank: int, **kw: Any) -> GlobalBatchSampler:
    kw.setdefault("seed", SEED)
    return GlobalBatchSampler(range(n), g, m, num_replicas=world, rank=rank, **kw)


def ceil_div(a: int, b: int) -> int:
    return -(a // -b)


def reference_batches(n: int, g: int, epoch: int, drop_last: bool) -> list[list[int]]:
    """The epoch's global batches, drawn as torch's sampler draws its order."""
    gen = torch.Generator()
    gen.manual_seed(SEED + epoch)
    order = torch.randperm(n, generator=gen).tolist()
    batches = [order[i : i + g] for i in range(0, n, g)]
    return [b for b in batches if len(b) == g] if drop_last else batches


def steps_of(s: GlobalBatchSampler, start: int = 0) -> list[list[list[int]]]:
    """This rank's micro-batches grouped by step (from ``start``, where a loaded state resumes),
    by the step counts the sampler states."""
    it = iter(s)
    counts = [s.micro_batches_in_step(k) for k in range(start, s.steps_per_epoch)]
    steps = [[next(it) for _ in range(c)] for c in counts]
    assert next(it, None) is None
    return steps


Layout = list[list[list[list[int]]]]  # [rank][step] -> that step's micro-batches


def layout(n: int, g: int, m: int, world: int, drop_last: bool, epoch: int = 0) -> Layout:
    """``[rank][step] -> micro-batches`` for every rank of ``world``."""
    samplers = [sampler(n, g, m, world, r, drop_last=drop_last) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return [steps_of(s) for s in samplers]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "g", "m"), CASES)
def test_each_step_is_its_global_batch_split_rank_by_rank(
    n: int, g: int, m: int, drop_last: bool
) -> None:
    if drop_last and n < g:
        return  # no full global batch: refused, see test_bad_arguments_name_the_setting
    for epoch in (0, 1):
        expected = reference_batches(n, g, epoch, drop_last)
        for world in WORLDS:
            ranks = layout(n, g, m, world, drop_last, epoch)
            assert all(len(rank) == len(expected) for rank in ranks), world
            for k, batch in enumerate(expected):
                shares = [sum(ranks[r][k], []) for r in range(world)]
                assert sum(shares, []) == batch, (world, k)  # in global order, rank by rank
                sizes = [len(s) for s in shares]
                assert max(sizes) - min(sizes) <= 1, (world, k, sizes)
                for r in range(world):
                    assert all(0 < len(mb) <= m for mb in ranks[r][k]), (world, r, k)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "g", "m"), CASES)
def test_every_sample_of_the_epoch_is_used_exactly_once(
    n: int, g: int, m: int, drop_last: bool
) -> None:
    if drop_last and n < g:
        return
    kept = n - n % g if drop_last else n
    for world in WORLDS:
        ranks = layout(n, g, m, world, drop_last)
        used = Counter(i for rank in ranks for step in rank for mb in step for i in mb)
        assert sum(used.values()) == kept, world
        assert set(used.values()) == {1}, world
        assert set(used) <= set(range(n))


def test_the_global_order_does_not_depend_on_the_world_size() -> None:
    orders = {
        (world, rank): sampler(26, 8, 2, world, rank).global_order()
        for world in WORLDS
        for rank in range(world)
    }
    assert len({tuple(o) for o in orders.values()}) == 1
    s = sampler(26, 8, 2, 1, 0)
    s.set_epoch(1)
    assert s.global_order() != orders[1, 0]  # but it changes with the epoch
    assert sampler(26, 8, 2, 3, 2, shuffle=False).global_order() == list(range(26))


@pytest.mark.parametrize(("n", "g", "m"), CASES)
def test_every_rank_runs_the_same_number_of_micro_batches_per_step(n: int, g: int, m: int) -> None:
    for world in WORLDS:
        ranks = layout(n, g, m, world, drop_last=False)
        for k, batch in enumerate(reference_batches(n, g, 0, drop_last=False)):
            count = ceil_div(ceil_div(len(batch), world), m)  # largest share / micro-batch
            for r in range(world):
                share = sum(ranks[r][k], [])
                # Fewer only where the share has fewer samples than that: one each, or none.
                assert len(ranks[r][k]) == min(count, len(share)), (world, r, k)
            if m > 1 and len(batch) >= world:
                assert {len(ranks[r][k]) for r in range(world)} == {count}, (world, k)
        s = sampler(n, g, m, world, world - 1)
        assert s.micro_batches_per_step == min(ceil_div(ceil_div(g, world), m), g // world)


def test_mark_step_ends_follows_the_loader_and_len_counts_micro_batches() -> None:
    for world in (2, 3):
        for rank in range(world):
            s = sampler(26, 7, 2, world, rank)
            loader = DataLoader(list(range(26)), batch_sampler=s)
            marked = [(b.tolist(), last) for b, last in s.mark_step_ends(loader)]
            steps = steps_of(sampler(26, 7, 2, world, rank))
            assert [b for b, _ in marked] == sum(steps, [])
            ends = [i == len(step) - 1 for step in steps for i in range(len(step))]
            assert [last for _, last in marked] == ends
            assert len(s) == len(loader) == len(marked)


def _take_steps(s: GlobalBatchSampler, k: int) -> list[int]:
    """Samples of the first ``k`` steps through a DataLoader (no workers), stopping right after
    the k-th step's last micro-batch, as a loop that saves after ``opt.step()``."""
    taken: list[int] = []
    done = 0
    loader = DataLoader(list(range(s.dataset_length)), batch_sampler=s)
    for batch, last in s.mark_step_ends(loader):
        taken += batch.tolist()
        done += last
        if done == k:
            break
    return taken


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("new_world", [2, 3])
def test_a_state_saved_at_four_ranks_continues_at_two_or_three(
    new_world: int, drop_last: bool
) -> None:
    n, g, m, k, epoch = 45, 8, 3, 2, 1
    batches = reference_batches(n, g, epoch, drop_last)
    before: list[int] = []
    states = []
    for rank in range(4):
        s = sampler(n, g, m, 4, rank, drop_last=drop_last)
        s.set_epoch(epoch)
        before += _take_steps(s, k)
        states.append(s.state_dict())
    assert all(state == states[0] for state in states)  # nothing of the rank or world size
    assert (states[0]["epoch"], states[0]["step"]) == (epoch, k)
    assert sorted(before) == sorted(sum(batches[:k], []))
    resumed = []
    for rank in range(new_world):
        s = sampler(n, g, m, new_world, rank, drop_last=drop_last)
        s.load_state_dict(states[rank])
        s.set_epoch(epoch)  # the loop's usual call keeps the resumed position
        resumed.append(steps_of(s, start=k))
        assert s.step == s.steps_per_epoch
    for j, batch in enumerate(batches[k:]):  # step k + 1 (k 0-based) first, rank by rank
        assert sum((sum(rank[j], []) for rank in resumed), []) == batch, j
    after = [i for rank in resumed for step in rank for mb in step for i in mb]
    used = Counter(before + after)
    assert set(used.values()) == {1}
    assert sum(used.values()) == sum(len(b) for b in batches)


def test_the_position_counts_whole_steps() -> None:
    s = sampler(26, 8, 2, 2, 0)
    it = iter(DataLoader(list(range(26)), batch_sampler=s))
    assert s.micro_batches_per_step == 2
    next(it)
    assert s.state_dict()["step"] == 0  # mid-step: that step is not done
    next(it)
    assert s.state_dict()["step"] == 1  # its last micro-batch is out: done after opt.step()
    list(it)
    assert s.state_dict()["step"] == s.steps_per_epoch == 4
    s.set_epoch(1)
    assert s.state_dict()["step"] == 0  # a new epoch starts at its beginning
    # A rank with an empty share of the short last step still ends the epoch at its end.
    empty = sampler(23, 7, 2, 3, 2)
    assert empty.micro_batches_in_step(3) == 0
    list(empty)
    assert empty.step == empty.steps_per_epoch == 4


def test_call_on_resume_runs_only_when_resuming_mid_epoch() -> None:
    calls: list[int] = []
    s = sampler(26, 8, 2, 2, 1)
    s.call_on_resume(lambda: calls.append(1))
    list(s)
    assert calls == []
    s.load_state_dict({**s.state_dict(), "step": 1})
    s.call_on_resume(lambda: calls.append(2))
    assert len(list(s)) == len(s) - s.micro_batches_per_step
    assert calls == [2]


def test_shares_are_equal_and_uneven_shares_warn_once_at_the_first_iteration() -> None:
    gc.collect()  # no wrapper of an earlier test lives on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = sampler(26, 7, 2, 3, 0)  # built before any wrapper: nothing said yet
    with pytest.warns(UserWarning, match=r'num_replicas=3 .*reduction="item_mean"') as caught:
        list(s)  # no gradsync wrapper lives: the job may mean
    assert len(caught) == 1
    assert [s.shares_are_equal(k) for k in range(4)] == [False] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)  # once per sampler
        s = sampler(26, 8, 2, 4, 0)  # only the short last step (2 samples) is uneven
    with pytest.warns(UserWarning, match=r"\[2\] samples over num_replicas=4"):
        s.micro_batches_of(0)  # Recovery's way in
    assert [s.shares_are_equal(k) for k in range(4)] == [True, True, True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sampler(26, 8, 2, 4, 0, drop_last=True))
        list(sampler(24, 6, 1, 3, 2))
        list(sampler(26, 7, 2, 1, 0))


@pytest.mark.parametrize("reduction", ["mean", "item_mean", "sum"])
def test_uneven_shares_warn_only_where_the_wrapper_means(one_rank: None, reduction: str) -> None:
    """The docs' loops build the sampler before the wrapper: the warning waits for it, and
    comes only where its reduction makes uneven shares differ from one process."""
    gc.collect()  # no wrapper of an earlier test lives on
    s = sampler(26, 7, 2, 3, 0)
    model = gradsync.DistributedDataParallel(torch.nn.Linear(2, 1), reduction=reduction)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(s)
    said = [str(w.message) for w in caught if "num_replicas=3" in str(w.message)]
    assert len(said) == (reduction == "mean"), (reduction, said)
    del model


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"g": 3, "world": 4}, ["global_batch_size=3", "num_replicas=4"]),
        ({"m": 0}, ["micro_batch_size", "0"]),
        ({"g": 2.5}, ["global_batch_size", "2.5"]),
        ({"rank": 4}, ["rank=4", "num_replicas=4"]),
        ({"world": 0, "rank": 0}, ["num_replicas", "0"]),
        ({"n": 7, "drop_last": True}, ["7 samples", "global_batch_size=8", "drop_last=True"]),
    ],
)
def test_bad_arguments_name_the_setting(kwargs: dict, words: list[str]) -> None:
    args = {"n": 26, "g": 8, "m": 2, "world": 4, "rank": 0, **kwargs}
    drop_last = args.pop("drop_last", False)
    with pytest.raises(UsageError) as info:
        sampler(**args, drop_last=drop_last)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_calls_name_the_setting() -> None:
    with pytest.raises(UsageError, match="num_replicas= and rank="):
        GlobalBatchSampler(range(8), 4)  # no process group here
    s = sampler(26, 8, 2, 2, 0)
    with pytest.raises(UsageError, match=r"step=4 .*steps_per_epoch=4"):
        s.micro_batches_in_step(4)
    with pytest.raises(UsageError, match="step=-1"):
        s.shares_are_equal(-1)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("seed", 6),
        ("shuffle", 0),
        ("dataset_length", 27),
        ("global_batch_size", 4),
        ("drop_last", 1),
    ],
)
def test_a_state_of_other_global_batches_is_refused(key: str, value: int) -> None:
    saved = {**sampler(26, 8, 2, 4, 1).state_dict(), key: value}
    s = sampler(26, 8, 2, 2, 0)
    with pytest.raises(CheckpointError, match=f"{key}={value}") as info:
        s.load_state_dict(saved)
    assert f"{key}={s.state_dict()[key]}" in str(info.value)
    assert (s.epoch, s.step) == (0, 0)


def test_a_state_that_is_not_a_global_batch_samplers_is_refused() -> None:
    s = sampler(26, 8, 2, 2, 0)
    other = DistributedSampler(range(26), num_replicas=2, rank=0).state_dict()
    with pytest.raises(CheckpointError, match="'step'"):
        s.load_state_dict(other)
    with pytest.raises(CheckpointError, match=r"step=5 .*steps_per_epoch=4"):
        s.load_state_dict({**s.state_dict(), "step": 5})


def test_a_micro_batch_size_change_on_resume_keeps_the_global_batches() -> None:
    saved = sampler(26, 8, 2, 4, 3).state_dict() | {"step": 1}
    s = sampler(26, 8, 4, 2, 1)  # micro_batch_size is not part of the state
    s.load_state_dict(saved)
    assert s.micro_batches_per_step == 1
    assert next(iter(s)) == reference_batches(26, 8, 0, drop_last=False)[1][4:]


def test_without_a_micro_batch_size_a_share_is_one_micro_batch() -> None:
    s = GlobalBatchSampler(range(26), 8, num_replicas=3, rank=2, seed=SEED)
    assert s.micro_batch_size == 3
    assert s.micro_batches_per_step == 1
    assert next(iter(s)) == reference_batches(26, 8, 0, drop_last=False)[0][6:]


def test_per_sample_randomness_depends_only_on_seed_epoch_and_index() -> None:
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert 0 <= sample_seed(1, 2, 3) < 2**63
    a = torch.rand(4, generator=sample_generator(1, 2, 3))
    torch.rand(10)  # the global stream in between changes nothing
    assert torch.equal(a, torch.rand(4, generator=sample_generator(1, 2, 3)))
    assert not torch.equal(a, torch.rand(4, generator=sample_generator(1, 3, 3)))
