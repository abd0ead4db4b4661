"""The edges of uneven data (issue 36, items 4 and 7), on real gloo ranks.

A short last global batch of one sample (22 samples in steps of 7) leaves every rank but rank 0
no share of the epoch's last step. The loop of docs/global-batches.md, with an LR schedule
stepped every step, then trains the one-process model to 1e-12 in float64 at 2 and 3 ranks and
across a change from 3 ranks to 2 through a ``Checkpointer`` save in the middle of an epoch,
because ``mark_step_ends`` gives the empty ranks a micro-batch of no sample and every rank runs
every step. The former advice, ``model.join(opt)`` around each epoch, is exact where the loop
body is ``step(); zero_grad()`` alone, and warns on every rank where it is not (a schedule).

A collective of the loop's own inside ``join()`` on the ranks with data ends in gradsync's
error on every rank: the rank out of data times out in the join, the others name it.

Three spawns: 3 ranks (saving the checkpoint), 2 ranks (loading it), and the misuse at 2.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.testing.spawn import spawn

N_SAMPLES, GLOBAL, MICRO, EPOCHS, SEED = 22, 7, 2, 3, 3  # global batches of 7, 7, 7 and 1
SAVE_AT = (1, 2)  # (epoch, global step): the 3-rank run saves there, mid-epoch
TOL = 1e-12  # float64; the sums over ranks add in another order than one process's

Params = dict[str, torch.Tensor]


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 4, generator=g, dtype=torch.float64)
    y = torch.randn(N_SAMPLES, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(params: Any, schedule: bool) -> tuple[torch.optim.Optimizer, Any]:
    """SGD with momentum (the .grad a step leaves behind would show) and, with ``schedule``,
    an LR that changes every step (a lagging schedule would show)."""
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    factor = (lambda s: 1.0 / (1 + 0.1 * s)) if schedule else (lambda s: 1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).squeeze(1) - y) ** 2).sum()


def params(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(schedule: bool) -> Params:
    """One process, each global batch whole, as torch's sampler draws the epoch's order."""
    data, model = make_data(), make_model()
    opt, sched = make_optimizer(model.parameters(), schedule)
    for epoch in range(EPOCHS):
        g = torch.Generator()
        g.manual_seed(SEED + epoch)
        for batch in torch.randperm(N_SAMPLES, generator=g).split(GLOBAL):
            x, y = data[batch]
            opt.zero_grad()
            (loss_sum(model, x, y) / len(batch)).backward()
            opt.step()
            sched.step()
    return params(model)


class Run:
    """One rank's wrapper, optimizer, schedule and sampler, and the loop of the docs."""

    def __init__(self, schedule: bool, micro: int | None = MICRO) -> None:
        self.ddp = gradsync.DistributedDataParallel(make_model(), reduction="item_mean", timeout=10)
        self.opt, self.sched = make_optimizer(self.ddp.parameters(), schedule)
        with warnings.catch_warnings():  # uneven shares warn for reduction="mean"
            warnings.simplefilter("ignore")
            self.sampler = GlobalBatchSampler(range(N_SAMPLES), GLOBAL, micro, seed=SEED)
        self.loader = DataLoader(make_data(), batch_sampler=self.sampler)
        self.last_sizes: list[int] = []  # this rank's samples in each epoch's last step

    def epoch(self, epoch: int, ckpt: Checkpointer | None = None) -> None:
        self.sampler.set_epoch(epoch)
        step = self.sampler.step
        for (x, y), last in self.sampler.mark_step_ends(self.loader):
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = loss_sum(self.ddp, x, y)
                self.ddp.count_items(len(y))
                loss.backward()
            if not last:
                continue
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            step += 1
            assert self.sampler.step == step, (self.sampler.step, step)
            if ckpt is not None and (epoch, step) == SAVE_AT:
                ckpt.save(epoch * self.sampler.steps_per_epoch + step)
        self.last_sizes.append(len(y))
        assert step == self.sampler.steps_per_epoch  # every rank ran every step


def exact_loop(folder: str | None, load: bool) -> dict[str, Any]:
    """The advised loop without join(), 3 epochs; saves at ``SAVE_AT`` into ``folder``, or
    with ``load`` continues from what was saved there."""
    run = Run(schedule=True)
    ckpt = None
    if folder is not None:
        ckpt = Checkpointer(folder, model=run.ddp, optimizer=run.opt, lr_scheduler=run.sched,
                            sampler=run.sampler, timeout=30)  # fmt: skip
        if load:
            with warnings.catch_warnings():  # the world size changed from 3 to 2
                warnings.simplefilter("ignore")
                assert ckpt.load() is not None
            ckpt = None
    for epoch in range(run.sampler.epoch, EPOCHS):
        run.epoch(epoch, ckpt)
    return {"params": params(run.ddp.module), "last_sizes": run.last_sizes}


def join_loop(schedule: bool) -> dict[str, Any]:
    """The former advice: each epoch inside ``model.join(opt)``, one micro-batch per step
    from the loader itself, so a rank with no share of the last step leaves its loop early and
    steps in a join round."""
    run = Run(schedule, micro=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            run.sampler.set_epoch(epoch)
            with run.ddp.join(run.opt):
                for x, y in run.loader:
                    loss = loss_sum(run.ddp, x, y)
                    run.ddp.count_items(len(y))
                    loss.backward()
                    run.opt.step()
                    run.sched.step()
                    run.opt.zero_grad()
    said = [str(w.message) for w in caught if "join" in str(w.message)]
    return {"params": params(run.ddp.module), "said": said}


def _joins() -> dict[str, Any]:
    return {"join": join_loop(schedule=False), "join_scheduled": join_loop(schedule=True)}


def _three(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {"exact": exact_loop(folder, load=False), **_joins()}


def _two(rank: int, world: int, folder: str) -> dict[str, Any]:
    resumed = exact_loop(folder, load=True)
    return {"exact": exact_loop(None, load=False), "resumed": resumed, **_joins()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("join-edges"))


@pytest.fixture(scope="module")
def three(folder: str) -> list[dict[str, Any]]:
    return spawn(_three, 3, (folder,), timeout_s=90)


@pytest.fixture(scope="module")
def two(folder: str, three: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return spawn(_two, 2, (folder,), timeout_s=90)  # loads what three ranks saved


def max_diff(a: Params, b: Params) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_the_advised_loop_is_one_process_with_empty_shares(
    world: int, two: list[dict[str, Any]], three: list[dict[str, Any]]
) -> None:
    ranks = {2: two, 3: three}[world]
    expected = reference(schedule=True)
    for rank, out in enumerate(ranks):
        exact = out["exact"]
        # Every rank but rank 0 had no sample in each epoch's last step, and ran it anyway.
        assert exact["last_sizes"] == [int(rank == 0)] * EPOCHS, (rank, exact["last_sizes"])
        assert max_diff(exact["params"], expected) < TOL, (world, rank)


@pytest.mark.timeout(120)
def test_a_mid_epoch_save_at_three_ranks_continues_at_two(two: list[dict[str, Any]]) -> None:
    expected = reference(schedule=True)
    for rank, out in enumerate(two):
        assert max_diff(out["resumed"]["params"], expected) < TOL, rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_join_is_exact_when_the_step_is_step_and_zero_grad(
    world: int, two: list[dict[str, Any]], three: list[dict[str, Any]]
) -> None:
    # The ranks out of data step in a join round; their .grad must not carry that round's
    # gradient into the next epoch's first step.
    expected = reference(schedule=False)
    for rank, out in enumerate({2: two, 3: three}[world]):
        assert max_diff(out["join"]["params"], expected) < TOL, (world, rank)
        assert out["join"]["said"] == [], out["join"]["said"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_join_warns_on_every_rank_when_a_schedule_lags(
    world: int, two: list[dict[str, Any]], three: list[dict[str, Any]]
) -> None:
    expected = reference(schedule=True)
    for out in {2: two, 3: three}[world]:
        # Not one process: the ranks out of data run the epoch's last step without sched.step().
        assert max_diff(out["join_scheduled"]["params"], expected) > 1e-4
        said = out["join_scheduled"]["said"]
        assert said, "a lagging LR schedule left join() silent"
        first = said[0]  # at the end of the first epoch: a warning per epoch
        assert len(said) == EPOCHS, said
        assert "join() was not exact" in first and "param group 0's lr" in first, first
        for rank in range(1, world):  # every rank but rank 0 ran the last step without data
            assert f"rank {rank}, which ran 1 of the others' steps" in first, first
        assert "rank 0," not in first and "mark_step_ends" in first, first


# -- a collective of the loop's own inside join(), on the ranks with data only -----------------
def _failure(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "text": str(exc),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
            "seconds": time.monotonic() - start,
        }
    return {"type": None}


def _misuse(rank: int, world: int) -> dict[str, Any]:
    data = make_data()

    def train(steps: int, after_step: Any) -> None:
        ddp = gradsync.DistributedDataParallel(make_model(), reduction="item_mean", timeout=3)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join(opt):
            for step in range(steps):
                x, y = data[2 * step + rank : 2 * step + rank + 1]
                loss = loss_sum(ddp, x, y)
                ddp.count_items(len(y))
                loss.backward()
                opt.step()
                opt.zero_grad()
                after_step(loss)

    def own_error(loss: torch.Tensor) -> None:  # every rank, while nobody is out of data
        raise RuntimeError("made up, in the words of gloo: Connection closed by peer")

    def log(loss: torch.Tensor) -> None:  # on the ranks that still have data only
        dist.all_reduce(loss.detach().clone())

    return {
        "own": _failure(lambda: train(1, own_error)),
        "log": _failure(lambda: train(3 - rank, log)),  # rank 0: 3 steps, rank 1: 2
    }


@pytest.mark.timeout(120)
def test_a_collective_of_the_loop_inside_join_ends_in_gradsyncs_error_on_every_rank() -> None:
    # pg_timeout_s above the wrapper's 3 s: rank 0's all_reduce fails when rank 1 gives up.
    zero, one = spawn(_misuse, 2, pg_timeout_s=30, timeout_s=60)
    for out in (zero, one):  # an error of the loop's own, nobody out of data: left as it is
        assert out["own"]["type"] == "RuntimeError" and out["own"]["cause"] is None, out["own"]
    waited, named = one["log"], zero["log"]
    # The rank out of data: its deadline in the join's handshake, naming what it waited for.
    assert waited["type"] == "CollectiveTimeoutError", waited
    assert "rank 1 gave up waiting for the join handshake" in waited["text"], waited
    assert "a logging all_reduce on some ranks only" in waited["text"], waited
    # The rank with data: gradsync's error instead of gloo's, naming rank 1, its verdict and
    # the mistake; gloo's error is its cause.
    assert named["type"] == "CollectiveTimeoutError", named
    text = named["text"]
    assert "rank 0: a collective the training loop issued itself inside model.join" in text, text
    assert "rank 1, last seen" in text and "out of data" in text, text
    assert "where it raised CollectiveTimeoutError: rank 1 gave up waiting" in text, text
    assert "Issue it outside the join" in text, text
    assert named["cause"] and named["cause"].startswith("RuntimeError"), named
    assert max(named["seconds"], waited["seconds"]) < 15, (named, waited)


def test_only_a_backend_error_while_a_rank_waits_in_join_becomes_gradsyncs() -> None:
    # No ranks: the arrival records of a peer waiting in the join, as a stub.
    from types import SimpleNamespace

    from gradsync.ddp.checks.join_exit import WAITING, foreign_collective_error

    def records(what: str) -> Any:
        peer = {1: (7, time.time(), what)}
        return SimpleNamespace(rank=0, arrivals=SimpleNamespace(read=lambda: peer))

    waits, works = records(WAITING), records("a training forward of step 3")
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
    nccl = dist.DistBackendError("NCCL communicator was aborted")
    converted = foreign_collective_error(gloo, waits)  # type: ignore[arg-type]
    assert isinstance(converted, gradsync.CollectiveTimeoutError), converted
    assert "rank 1, last seen" in str(converted) and "Connection closed" in str(converted)
    assert foreign_collective_error(nccl, waits) is not None  # type: ignore[arg-type]
    for exc, deadline in [
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), waits),  # the loop's own
        (ValueError("gloo"), waits),
        (KeyboardInterrupt(), waits),
        (gradsync.ProtocolError("gloo"), waits),  # gradsync's own already says what it is
        (gloo, works),  # nobody out of data: not join()'s business
    ]:
        assert foreign_collective_error(exc, deadline) is None, exc  # type: ignore[arg-type]


def test_mark_step_ends_gives_an_empty_share_a_batch_of_no_sample() -> None:
    from collections import namedtuple

    from gradsync.data.no_sample import cut_to_no_sample

    sampler = GlobalBatchSampler(range(N_SAMPLES), GLOBAL, MICRO, num_replicas=3, rank=2)
    loader = DataLoader(make_data(), batch_sampler=sampler)
    with warnings.catch_warnings():  # no wrapper: uneven shares warn at the first iteration
        warnings.simplefilter("ignore")
        marked = list(sampler.mark_step_ends(loader))
    assert sum(last for _, last in marked) == sampler.steps_per_epoch == 4
    (x, y), last = marked[-1]
    assert last and x.shape == (0, 4) and y.shape == (0,) and x.dtype == torch.float64
    assert len(marked) == len(sampler) + 1 and sampler.step == 4  # one item the sampler lacks
    with pytest.raises(gradsync.UsageError, match="needs the DataLoader itself"):
        list(sampler.mark_step_ends(list(loader)))
    Pair = namedtuple("Pair", "x names")
    cut = cut_to_no_sample({"a": Pair(torch.ones(2, 3), ["s", "t"]), "n": 7})
    assert cut["a"].x.shape == (0, 3) and cut["a"].names == [] and cut["n"] == 7
