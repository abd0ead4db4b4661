"""A rank that dies inside a collective is named, as dead, by every survivor within the deadline.

A rank that died while it waited in the collective has an arrival record that says it reached
the operation, like everyone's; one killed in its backward, before it waited, has not written
it ([Note: records written when waiting] in ``gradsync/failfast/arrivals.py``) and is named
with the last operation every rank took part in. What names it dead is the roll call after the
failure (``gradsync/failfast/liveness.py``): on one host, its process is gone. Three
ranks, so that "which one" means something: rank 2 dies, ranks 0 and 1 must both name rank 2.
When the dead rank took the store along (rank 0 serves it without torchrun), the survivors name
it from the processes they read at construction. Each case gets fresh processes
(``fresh=True``): a rank that kills itself is the point, and the survivors' view of its
process (gone, exit code) is what they must report. The roll call itself (a rank on another host, a
store that hangs) is tested in-process below.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from test_behaviour import error_text

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.failfast.arrivals import ArrivalRecords
from gradsync.failfast.liveness import Fate, ProcessId, process_state, roll_call, this_process
from gradsync.testing.spawn import RankFailure, spawn

import toy

WORLD = 3
CULPRIT = 2
DEADLINE = 6.0  # generous for a loaded 2-core machine: a lost peer is named long before it


def _die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


class _DyingSGD(torch.optim.SGD):
    """SGD whose step kills the culprit once ``armed``: inside ZeRO's step, before its gather."""

    armed = False

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        if _DyingSGD.armed:
            _die("sigkill")
        return super().step(closure)


def _step(ddp: gradsync.DistributedDataParallel, rank: int, world: int, step: int) -> None:
    toy.loss_fn(ddp, toy.shard(toy.global_batch(step), rank, world), "mean").backward()


def _die_inside(
    rank: int, world: int, how: str, where: str, culprit: int = CULPRIT, port: int = 0
) -> tuple[str | None, float]:
    """One synchronised step, then ``culprit`` dies inside the next step's collective ``where``
    ("all-reduce": a bucket's, "ring": gradsync's ring of sends, "zero": ZeRO's all-gather;
    "waiting": a bucket's, once it has waited there a while, for rank 0, who comes late);
    the survivors' error text and how long they waited for it. With ``port`` the job runs on
    a TCP store served by rank 0's process, as ``init_process_group`` makes without torchrun."""
    if port:
        dist.destroy_process_group()
        url = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    model = toy.make_model("plain", 0)
    algorithm = "ring" if where == "ring" else "native"
    ddp = gradsync.DistributedDataParallel(model, timeout=DEADLINE, algorithm=algorithm)
    opt = ddp.shard_optimizer(_DyingSGD, lr=0.1) if where == "zero" else None
    _step(ddp, rank, world, 0)
    if opt is not None:
        opt.step()
    if rank == culprit and opt is not None:
        _DyingSGD.armed = True
    elif rank == culprit and where == "waiting":
        # Dies from a thread, long after its wait began (and wrote its record to the store).
        die = threading.Timer(0.5, _die, (how,))
        model.body.weight.register_post_accumulate_grad_hook(lambda _: die.start())
    elif rank == culprit:
        # Runs after gradsync's own hook on this parameter: the culprit has begun the step's
        # reduction, but not waited in it, and the others wait for it in the all-reduce.
        model.body.weight.register_post_accumulate_grad_hook(lambda _: _die(how))
    t0 = time.monotonic()

    def next_step() -> None:
        if rank == 0 and where == "waiting":
            time.sleep(1.5)  # the all-reduce cannot end before the culprit dies
        _step(ddp, rank, world, 1)
        if opt is not None:
            opt.step()

    return error_text(next_step), time.monotonic() - t0


# Where a culprit killed before it waited was last seen: the last operation that every rank took
# part in, the previous step's.
_BEFORE = {
    "all-reduce": "the gradient reduction of step 0",
    "ring": "the gradient reduction of step 0",
    "zero": "the sharded optimizer's step 1",
}


def _check_survivors(results: list, how: str, where: str) -> None:
    culprit = results[CULPRIT]
    assert isinstance(culprit, RankFailure), culprit
    assert ("SIGKILL" if how == "sigkill" else "code 1") in culprit.message, culprit
    for rank in range(WORLD):
        if rank == CULPRIT:
            continue
        text, waited = results[rank]
        assert text and text.startswith("CollectiveTimeoutError"), (rank, text)
        inside = f"rank {CULPRIT} died inside it (its process " in text
        last_seen = re.search(
            rf"rank {CULPRIT}: last seen [0-9.]+ s ago at [^;]*{_BEFORE.get(where, '')}", text
        )
        if where == "waiting":  # it had written its record: it died in the operation
            assert inside and not last_seen, (rank, text)
        elif where == "zero":  # killed in the sharded step: inside it where one of the step's
            # collectives had ended on the survivor (every rank took part), or where the
            # culprit had waited 50 ms in one; else last seen at the step before
            assert inside or last_seen, (rank, text)
        else:  # killed in its backward, before it waited: last seen where every rank was
            assert last_seen and "(then it died: its process " in text, (rank, text)
        assert "is gone)" in text, (rank, text)
        assert waited < DEADLINE + 1, (rank, waited, text)  # the deadline, then a roll call
        # In a ring only the dead rank's neighbours see it go at once; the third waits for a
        # message that never comes, so it may not have answered yet. On gloo, ZeRO's all-gather
        # runs on gradsync's ring too.
        ring = where in ("ring", "zero")
        for other in set(range(WORLD)) - {CULPRIT}:  # no survivor is called dead
            assert f"rank {other} died" not in text, (rank, text)
            assert f"rank {other} did not answer after the failure: dead" not in text, text
            if not ring:
                assert f"rank {other} did not answer" not in text, (rank, text)
        if where in ("all-reduce", "waiting"):
            assert "lost a peer" in text, (rank, text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "where"),
    [("sigkill", "all-reduce"), ("exit", "ring"), ("sigkill", "zero"), ("sigkill", "waiting")],
)
def test_a_rank_that_dies_inside_a_collective_is_named_dead_by_every_survivor(
    how: str, where: str
) -> None:
    results = spawn(
        _die_inside, WORLD, (how, where), return_failures=True, timeout_s=90, fresh=True
    )
    _check_survivors(results, how, where)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_a_dead_rank_that_served_the_store_is_named_without_it() -> None:
    # No roll call without a store: the survivors look up the processes they read at
    # construction, and say that the store went with rank 0.
    results = spawn(
        _die_inside, WORLD, ("sigkill", "all-reduce", 0, _free_port()), return_failures=True,
        timeout_s=90, fresh=True,
    )  # fmt: skip
    assert isinstance(results[0], RankFailure) and "SIGKILL" in results[0].message, results[0]
    for rank in (1, 2):
        text, waited = results[rank]
        assert text and text.startswith("CollectiveTimeoutError"), (rank, text)
        assert "lost a peer" in text and "the c10d store failed" in text, (rank, text)
        assert re.search(r"rank 0 is gone \(its process \d+ on host \S+ has exited\)", text), text
        assert waited < DEADLINE, (rank, waited, text)


def _die_before_saving(rank: int, world: int, folder: str) -> tuple[str | None, float]:
    """Two steps and a save; then ``CULPRIT`` dies while the others check the next save."""
    ddp = gradsync.DistributedDataParallel(toy.make_model("plain", 0), timeout=DEADLINE)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ckpt = Checkpointer(folder, model=ddp, optimizer=opt, timeout=DEADLINE)
    _step(ddp, rank, world, 0)
    opt.step()
    ckpt.save(1)
    if rank == CULPRIT:
        _die("sigkill")
    t0 = time.monotonic()
    return error_text(lambda: ckpt.save(2)), time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_rank_that_dies_during_a_checkpoint_is_named_by_the_others(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The checkpointer's own agreement collectives run under its deadline too: a bare gloo
    # "Connection reset by peer" was all the survivors of a lost node saw before.
    results = spawn(
        _die_before_saving, WORLD, (str(tmp_path / "ckpt"),), return_failures=True, timeout_s=90,
        fresh=True,
    )  # fmt: skip
    assert isinstance(results[CULPRIT], RankFailure), results[CULPRIT]
    for rank in range(WORLD):
        if rank != CULPRIT:
            text, waited = results[rank]
            assert text and text.startswith("CollectiveTimeoutError"), (rank, text)
            assert "the check before saving step 2" in text, (rank, text)
            assert re.search(rf"rank {CULPRIT}\b.*its process \d+ on host \S+ is gone", text), text
            assert waited < DEADLINE + 3, (rank, waited, text)


# -- the roll call, in this process ---------------------------------------------------------------
def _elsewhere(pid: int) -> ProcessId:
    return ProcessId(pid, 1, "another-boot/pid:[1]", "other-host")


@pytest.mark.timeout(30)
def test_the_roll_call_tells_the_dead_from_the_silent_and_the_living() -> None:
    store = dist.HashStore()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        here = this_process()

        def local(pid: int) -> ProcessId:
            return ProcessId(pid, 0, here.space, here.host)

        store.set("alive/1", "alive")  # rank 1, on another host, answered
        others = {
            1: ("alive/1", _elsewhere(1)),
            2: ("alive/2", _elsewhere(2)),  # another host, no answer: dead or stuck
            3: ("alive/3", local(dead.pid)),
            4: ("alive/4", local(live.pid)),
            5: ("alive/5", local(stopped.pid)),
        }
        t0 = time.monotonic()
        fates = roll_call(store, "alive/0", others, 0.5)
        waited = time.monotonic() - t0
        assert store.check(["alive/0"])  # this rank answered
        assert fates == {
            1: Fate.ANSWERED, 2: Fate.SILENT, 3: Fate.GONE, 4: Fate.RUNNING, 5: Fate.STOPPED
        }  # fmt: skip
        assert 0.5 <= waited < 2.0, waited  # the silent ones were waited for, boundedly
        # A pid reused by another process is not the process that wrote the record.
        reused = ProcessId(live.pid, here.start + 1, here.space, here.host)
        assert process_state(reused) == "gone"
        assert process_state(here) == "running"
        assert process_state(_elsewhere(os.getpid())) is None  # another pid space: unknown
        # Everyone accounted for: no waiting at all.
        t0 = time.monotonic()
        assert roll_call(store, "alive/0", {3: others[3], 1: others[1]}, 5.0) == {
            3: Fate.GONE, 1: Fate.ANSWERED
        }  # fmt: skip
        assert time.monotonic() - t0 < 1.0
    finally:
        for p in (live, stopped):
            p.kill()
            p.wait()


class _HungStore:
    """A store whose host is gone without closing the connection: every call blocks."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: time.sleep(3600)


@pytest.mark.timeout(30)
def test_a_hung_store_is_given_up_and_said_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        arrivals = ArrivalRecords(None, "hung store")
        arrivals.store = _HungStore()  # type: ignore[assignment]
        t0 = time.monotonic()
        text = arrivals.after_failure(3, "a step", 0.3)
        assert time.monotonic() - t0 < 1.5
        assert "the c10d store failed (it did not answer within 0.8 s" in text, text
        assert "so no rank can be named" in text, text  # none was read before it hung
        assert arrivals.store is None  # later records do not queue behind the stuck call
        arrivals.record(4, "the next step")  # returns at once
        assert time.monotonic() - t0 < 2.0
    finally:
        dist.destroy_process_group()
