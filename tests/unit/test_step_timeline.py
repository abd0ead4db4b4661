"""The step timeline's parts on their own: phases from marks, slots in a bucket, attribution.

A scripted clock stands in for time (and for CUDA events: the recorder only ever asks the clock
for marks and for the milliseconds between two of them), so every phase is known exactly.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp.checks import tags
from gradsync.ddp.checks.tags import StepTag
from gradsync.ddp.tail import GivenRider, TailLayout
from gradsync.timing import PHASES, RankStep, StepTimeline, Thresholds, slots
from gradsync.timing.attribution import attribute, describe, metrics
from gradsync.timing.clock import DeviceClock
from gradsync.timing.phases import PhaseRecorder
from gradsync.timing.slots import LIMIT_MS, MAX_LAUNCHES, decode, encode, fields_per_rank


class ScriptedClock:
    """``now`` is set by the test; a mark is the time it was taken (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> Any:
        return self.now

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def reached(self, mark: Any) -> bool:
        return True

    def release(self, marks: list[Any]) -> None:
        pass


class LaggingClock(ScriptedClock):
    """A GPU behind the host: a mark is reached once ``gpu`` (seconds) has passed it."""

    def __init__(self) -> None:
        super().__init__()
        self.gpu = 0.0
        self.waited = 0  # elapsed_ms calls whose end was not reached (a host-GPU wait)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.reached(end):  # the host waits until the GPU gets there
            self.waited += 1
            self.gpu = end
        return super().elapsed_ms(start, end)

    def reached(self, mark: Any) -> bool:
        return bool(mark <= self.gpu)


def _at(clock: ScriptedClock, t_ms: float) -> None:
    clock.now = t_ms / 1e3


def _step(rec: PhaseRecorder, clock: ScriptedClock, t0: float, micro: int = 1) -> float:
    """One synchronised step starting at ``t0`` ms: per micro-batch 2 ms of data, 3 ms forward,
    5 ms backward; the last reduces (its bucket launched 1 ms into backward, 4 ms exposed)."""
    t = t0
    for m in range(micro):
        t += 2
        _at(clock, t)
        rec.forward_began()
        t += 3
        _at(clock, t)
        rec.forward_ended()
        if m == micro - 1:
            _at(clock, t + 1)
            rec.launched(0)
        t += 5
        _at(clock, t)
        rec.backward_ended()
    t += 4
    _at(clock, t)
    rec.synced()
    return t


def test_phases_tile_the_interval_between_two_steps() -> None:
    clock = ScriptedClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)
    assert rec.resolve() is None  # before the first synchronised step: nothing to measure
    t = _step(rec, clock, t, micro=2)  # two micro-batches (the first under no_sync)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    _at(clock, t + 1)
    opt.step()  # timed by torch's global step hooks: 0 ms on the scripted clock
    got = rec.resolve()
    assert got is not None
    assert dict(zip(PHASES, got.phases, strict=True)) == pytest.approx(
        {"data": 4.0, "forward": 6.0, "backward": 10.0, "optimizer": 0.0, "exposed_comm": 4.0}
    )
    assert got.interval == pytest.approx(24.0) and got.busy == pytest.approx(20.0)
    assert got.launches == pytest.approx((16.0,))  # the second micro-batch's forward + 1 ms


def test_the_optimizer_step_is_its_own_phase_outermost_only() -> None:
    clock = ScriptedClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)
    inner = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    class Outer(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            clock.now += 0.003
            inner.step()  # a wrapped optimizer's step: not counted twice
            clock.now += 0.004
            return super().step(closure)

    outer = Outer([nn.Parameter(torch.zeros(1))], lr=0.1)
    _at(clock, t + 1)
    outer.step()
    _step(rec, clock, clock.now * 1e3 - 2)
    got = rec.resolve()
    assert got is not None and got["optimizer"] == pytest.approx(7.0)


def test_a_step_that_raised_is_not_measured() -> None:
    clock = ScriptedClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)
    t = _step(rec, clock, t)
    rec.abandon()
    assert rec.resolve() is None
    _step(rec, clock, t)
    assert rec.resolve() is None  # the interval after it has no measured start either


def test_one_rank_on_a_gpu_reads_an_interval_a_step_late_rather_than_wait_for_the_gpu() -> None:
    # [Note: reading a GPU interval late]: with one rank nothing waits for the GPU at the
    # readout; reading the interval just closed would wait for it every step.
    clock = LaggingClock()
    timeline = StepTimeline(1, rank=0, world_size=1, device=torch.device("cpu"))
    rec = timeline.recorder = PhaseRecorder(clock)
    width = fields_per_rank(1)
    t = 0.0
    for step in range(6):
        values = timeline.outgoing(1) or [0.0] * width  # one rank's tail: what it wrote
        t = _step(rec, clock, t + step)  # step s has s ms more of data: its interval 14 + s
        if step == 4:
            clock.gpu = clock.now  # the GPU catches up (say, the loop read the loss)
        else:
            clock.gpu = clock.now - 0.012  # still in this step's backward
        timeline.received(values, step)
        assert rec.late == (1 if step in (2, 3) else 0)  # 1 and 5: nothing read yet
    assert clock.waited == 0
    # Each record under the step whose end closed it: 14 ms + that step's extra data.
    got = {s: recs[0].interval for s, recs in timeline.history if recs[0] is not None}
    assert got == pytest.approx({1: 15.0, 2: 16.0, 4: 18.0})  # 3: dropped when the GPU caught up


class _ScriptedEvent:
    """A CUDA event's part that DeviceClock uses: recorded at the scripted clock's time."""

    clock: ScriptedClock = ScriptedClock()
    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        type(self).created += 1
        self.t: float | None = None

    def record(self, stream: object = None) -> None:
        self.t = self.clock.now

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _ScriptedEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


def test_a_gpus_marks_are_recorded_again_once_their_interval_was_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Creating a CUDA event costs the host ~12 us at its first record: DeviceClock keeps them.
    # A mark released too early (the end of an interval, which starts the next) would move
    # the next interval's start, and its duration with it.
    scripted = ScriptedClock()
    monkeypatch.setattr(_ScriptedEvent, "clock", scripted)
    monkeypatch.setattr(_ScriptedEvent, "created", 0)
    monkeypatch.setattr(torch.cuda, "Event", _ScriptedEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    rec = PhaseRecorder(DeviceClock(torch.device("cuda", 0)))
    t, got = 0.0, []
    for step in range(20):
        t = _step(rec, scripted, t + step, micro=2)  # step s has s ms more of data
        record = rec.resolve()
        got.append(None if record is None else record.interval)
    assert got[0] is None  # the first step's interval has no start
    assert got[1:] == pytest.approx([24.0 + s for s in range(1, 20)])
    assert _ScriptedEvent.created <= 20  # about a step's marks (9), not 9 a step


def test_a_gpu_more_than_a_step_behind_is_waited_for_at_the_older_interval() -> None:
    clock = LaggingClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)
    t = _step(rec, clock, t)
    assert rec.resolve() is None and clock.waited == 0  # not reached: kept
    _step(rec, clock, t)
    got = rec.resolve()  # the older one, waited for: the newest stays pending
    assert got is not None and got.interval == pytest.approx(14.0)
    assert rec.late == 1 and clock.waited == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_slots_carry_each_ranks_record_and_nothing_for_the_others(dtype: torch.dtype) -> None:
    # Both riders of bucket 0's tail, as the reducer lays them out: every rank's step tag and
    # timings come back from the sum, and a rank that sent none reads as None in both.
    world, buckets = 3, 40
    width = fields_per_rank(buckets)
    assert width == 1 + len(PHASES) + MAX_LAUNCHES
    records = [RankStep((1.0, 20.0, 30.5, 2.0, 4.0), (3.0, 9.0)), None, RankStep((1e6,) * 5)]
    step_tags = [StepTag(7, 2, 1, 130, 3, 300), None, StepTag(7, 2, 1, 130, 0)]
    summed = torch.zeros(world * (tags.NUM_FIELDS + width), dtype=dtype)
    riders = [GivenRider(tags.RIDER, tags.NUM_FIELDS), GivenRider(slots.RIDER, width)]
    for rank, (record, tag) in enumerate(zip(records, step_tags, strict=True)):
        tail = TailLayout(world, rank, riders)
        values = torch.full((tail.numel,), 5.0, dtype=dtype)  # stale: write() zeroes it
        tail.write(
            values,
            {
                tags.RIDER: tag.encode() if tag is not None else None,
                slots.RIDER: encode(record, buckets) if record is not None else None,
            },
        )
        summed += values
    riders_read = tail.read(summed.double().tolist())
    assert tags.decode(riders_read[tags.RIDER], world) == [
        StepTag(7, 2, 1, 130 % tags.MODULUS, 3, 300 % tags.MODULUS),
        None,
        StepTag(7, 2, 1, 130 % tags.MODULUS, 0),
    ]
    got = decode(riders_read[slots.RIDER], world)
    assert got[1] is None
    assert got[0] is not None and got[2] is not None
    assert got[0].phases == pytest.approx(records[0].phases, rel=1e-2)
    assert got[0].launches[:2] == pytest.approx((3.0, 9.0), rel=1e-2)
    assert got[0].launches[2:] == (0.0,) * (MAX_LAUNCHES - 2)  # not known
    assert max(got[2].phases) <= LIMIT_MS * 1.01  # clamped to what fp16 holds


def test_the_tail_lays_riders_out_in_order_and_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="twice"):
        TailLayout(2, 1, [GivenRider("a", 1), GivenRider("a", 2)])
    tail = TailLayout(world_size=2, rank=1, riders=[GivenRider("a", 2), GivenRider("b", 3)])
    assert (tail.offsets, tail.width, tail.numel) == ([0, 2], 5, 10)
    with pytest.raises(ValueError, match="holds 9 values"):
        tail.write(torch.zeros(9), {})
    values = torch.zeros(10)
    with pytest.raises(ValueError, match="expected 3"):
        tail.write(values, {"b": [1.0]})
    tail.write(values, {"b": [1.0, 2.0, 3.0]})  # rank 1's record: the second half, after its "a"
    assert values.tolist() == [0.0] * 7 + [1.0, 2.0, 3.0]
    assert tail.written == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert tail.read(values.tolist()) == {"a": [0.0] * 4, "b": [0.0] * 3 + [1.0, 2.0, 3.0]}
    tail.write(values, None)  # a rank that has joined: zeros from it too
    assert values.tolist() == [0.0] * 10


def _record(forward: float, data: float = 2.0, launch: float = 10.0) -> RankStep:
    # The interval is the same on every rank: what one rank spends more, it waits less.
    busy = data + forward + 30.0 + 3.0
    return RankStep((data, forward, 30.0, 3.0, 100.0 - busy), (launch, launch + 5.0))


def _window(steps: int, late_rank: int | None, late_ms: float, seed: int = 0) -> list:
    noise = random.Random(seed)
    window = []
    for s in range(steps):
        recs = []
        for r in range(4):
            jitter = noise.uniform(-1.0, 1.0)
            extra = late_ms if r == late_rank else 0.0
            recs.append(_record(20.0 + jitter + extra, launch=10.0 + jitter + extra))
        window.append((s, recs))
    return window


def test_a_rank_late_in_its_forward_is_named_with_what_it_cost() -> None:
    report = attribute(_window(10, late_rank=3, late_ms=40.0))
    [named] = report["stragglers"]
    assert (named["rank"], named["phase"], named["late_in"], named["of"]) == (3, "forward", 10, 10)
    assert named["late_ms"] == pytest.approx(40.0, abs=1.5)
    assert named["job_lost_pct"] == pytest.approx(40.0, abs=2.0)  # of a 100 ms interval
    assert report["ranks"][3]["bucket_late_ms"] == pytest.approx([40.0, 40.0], abs=2.5)
    assert describe(report) == [
        f"gradsync: rank 3 arrived late in 10 of the last 10 steps, "
        f"+{named['late_ms']:.1f} ms/step, in the forward (the job lost "
        f"{named['job_lost_pct']:.0f}% of its time waiting for it)"
    ]


def test_noise_and_a_late_rank_below_the_threshold_name_nobody() -> None:
    assert attribute(_window(10, late_rank=None, late_ms=0.0))["stragglers"] == []
    # 4 ms late per step: under the 5 ms floor (5 % of 100 ms is 5 ms too)
    assert attribute(_window(10, late_rank=1, late_ms=4.0))["stragglers"] == []
    assert attribute(_window(10, late_rank=1, late_ms=4.0), Thresholds(min_late_ms=2.0,
                     min_late_fraction=0.0))["stragglers"][0]["rank"] == 1  # fmt: skip


def test_a_rank_late_in_only_a_few_steps_is_not_named() -> None:
    window = _window(10, late_rank=None, late_ms=0.0)
    for s in (2, 7):  # one 200 ms hiccup in two of ten steps: on average 40 ms late
        recs = list(window[s][1])
        recs[2] = _record(220.0)
        window[s] = (s, recs)
    assert attribute(window)["stragglers"] == []


def _stall_window(step_ms: float, stall_ms: float, rank: int = 1) -> list:
    """10 steps of ``step_ms`` on 4 ranks; ``rank`` spends ``stall_ms`` more loading data in
    steps 2 and 7, and the others wait for it (every rank's interval grows by it)."""
    window = []
    for s in range(10):
        stalled = s in (2, 7)
        recs = []
        for r in range(4):
            mine, theirs = (stall_ms, 0.0) if r == rank else (0.0, stall_ms)
            wait = step_ms / 4 + (theirs if stalled else 0.0)  # exposed_comm
            recs.append(RankStep((step_ms / 4 + (mine if stalled else 0.0), step_ms / 4,
                                  step_ms / 8, step_ms / 8, wait)))  # fmt: skip
        window.append((s, recs))
    return window


def test_a_periodic_stall_is_named_with_its_share_of_the_windows_time() -> None:
    # The example: late by 40 ms in 2 of 10 steps of 20 ms. The others waited 80 ms
    # of the window's 280 ms (8 steps of 20 ms, 2 of 60 ms): 28.6 %.
    report = attribute(_stall_window(20.0, 40.0))
    assert report["stragglers"] == [] and report["window_ms"] == pytest.approx(280.0)
    [stall] = report["stalls"]
    assert (stall["rank"], stall["phase"], stall["late_in"], stall["of"]) == (1, "data", 2, 10)
    assert stall["late_ms"] == pytest.approx(40.0)  # the mean over the 2 steps, not the 10
    assert stall["job_lost_pct"] == pytest.approx(100.0 * 80.0 / 280.0)
    assert report["ranks"][1]["lost_ms"] == pytest.approx(80.0)
    assert describe(report) == [
        "gradsync: rank 1 was late in 2 of the last 10 steps by 40.0 ms, in data loading "
        "(between steps), costing the job 29% of its time"
    ]
    flat = metrics(report)
    assert flat["gradsync/stalls"] == 1.0 and flat["gradsync/stragglers"] == 0.0
    assert flat["gradsync/rank1/lost_pct"] == pytest.approx(28.57, abs=0.01)
    assert flat["gradsync/rank0/lost_pct"] == 0.0


def test_a_stall_is_not_hidden_by_small_lateness_in_other_steps() -> None:
    # Two 100 ms stalls in steps of 20 ms; in four other steps the same rank is 6 ms late and
    # so is another rank in four more (noise on a loaded machine): the mean over all six steps
    # rank 1 was late in is 36.7 ms, but the stall is the two steps, and the report gives their
    # figures only (the 6 ms steps are within the noise the other ranks show).
    window = _stall_window(20.0, 100.0)
    for s, rank in ((1, 1), (4, 1), (5, 1), (8, 1), (0, 2), (3, 3), (6, 2), (9, 3)):
        recs = list(window[s][1])
        recs[rank] = RankStep((11.0, 5.0, 2.5, 2.5, 5.0))  # 6 ms more data loading
        window[s] = (s, recs)
    report = attribute(window)
    assert report["ranks"][1]["late_in"] == 6 and report["ranks"][1]["lost_ms"] < 40.0 * 6
    assert report["ranks"][1]["noise_ms"] == pytest.approx(6.0)
    [stall] = report["stalls"]
    assert (stall["rank"], stall["phase"], stall["late_in"]) == (1, "data", 2)
    assert stall["late_ms"] == pytest.approx(100.0)
    assert stall["job_lost_pct"] == pytest.approx(100.0 * 200.0 / report["window_ms"])


def test_a_stall_that_costs_little_is_only_a_figure() -> None:
    # 40 ms in 2 of 10 steps of 400 ms: 80 of 4080 ms, 2 %, under the 10 % share
    cheap = attribute(_stall_window(400.0, 40.0))
    assert cheap["stalls"] == [] and cheap["ranks"][1]["lost_pct"] == pytest.approx(1.96, abs=0.01)
    # late in every step: named as a straggler, in one line, not as a stall as well
    report = attribute(_window(10, late_rank=3, late_ms=40.0))
    assert [s["rank"] for s in report["stragglers"]] == [3] and report["stalls"] == []
    assert len(describe(report)) == 1


def test_a_rank_that_sent_no_record_is_left_out() -> None:
    window = [(s, [*recs[:3], None]) for s, recs in _window(10, late_rank=1, late_ms=30.0)]
    report = attribute(window)
    assert [s["rank"] for s in report["stragglers"]] == [1]
    assert 3 not in report["ranks"]
    assert attribute([(0, [_record(20.0), None])])["num_steps"] == 0  # one rank: no comparison


def test_metrics_are_flat_numbers() -> None:
    flat = metrics(attribute(_window(10, late_rank=3, late_ms=40.0)))
    assert flat["gradsync/stragglers"] == 1.0 and flat["gradsync/num_steps"] == 10.0
    assert flat["gradsync/rank3/late_ms"] == pytest.approx(40.0, abs=1.5)
    assert all(isinstance(v, float) for v in flat.values())
    # A report of no step says so, not "no straggler".
    assert metrics(attribute([])) == {"gradsync/num_steps": 0.0}


def test_straggler_every_zero_measures_and_carries_nothing(one_rank: None) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    on = gradsync.DistributedDataParallel(net, straggler_every=3)
    off = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)),
                                           straggler_every=0)  # fmt: skip
    for model in (on, off):
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
    one_tag = tags.NUM_FIELDS  # one rank's step tag
    assert off.reducer.buckets[0].tail.numel() == one_tag
    assert on.reducer.buckets[0].tail.numel() == one_tag + fields_per_rank(on.num_buckets)
    assert not off.timeline.history and len(on.timeline.history) == 2  # one step behind
    assert off.timeline.metrics() == {"gradsync/num_steps": 0.0}  # not measured: no figures
    with pytest.raises(gradsync.UsageError, match="straggler_every"):
        gradsync.DistributedDataParallel(nn.Linear(2, 2), straggler_every=-1)


def test_a_timeline_on_its_own_keeps_the_last_steps() -> None:
    timeline = StepTimeline(2, rank=0, world_size=2, device=torch.device("cpu"), keep=3)
    width = fields_per_rank(1)
    for step in range(6):
        values = [0.0] * (2 * width)
        values[0], values[width] = 1.0, 1.0
        timeline.received(values, step)
    assert [s for s, _ in timeline.history] == [2, 3, 4]
    assert timeline.last_report is not None and timeline.last_report["num_steps"] == 2


def test_a_closure_inside_the_optimizer_step_counts_as_forward_and_backward() -> None:
    # Lightning's automatic optimization: optimizer.step(closure) runs forward and backward
    # (which synchronises) inside the step; the update after it is the optimizer's.
    clock = ScriptedClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)
    param = nn.Parameter(torch.zeros(1))

    def closure() -> torch.Tensor:
        _step(rec, clock, clock.now * 1e3)  # 2 ms data, 3 forward, 5 backward, 4 exposed
        return torch.zeros(())

    class Slow(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            closure()
            clock.now += 0.006  # the update itself
            return super().step()

    opt = Slow([param], lr=0.1)
    _at(clock, t + 1)
    opt.step(closure)
    _step(rec, clock, clock.now * 1e3)  # the next step, with the closure's sync behind it
    got = rec.resolve()
    assert got is not None
    assert got["optimizer"] == pytest.approx(6.0)  # after the closure's sync: the update
    assert got["forward"] == pytest.approx(3.0) and got["backward"] == pytest.approx(5.0)


def test_an_optimizer_step_that_raised_does_not_stop_the_timing_of_later_ones() -> None:
    clock = ScriptedClock()
    rec = PhaseRecorder(clock)
    t = _step(rec, clock, 0.0)

    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            clock.now += 0.005
            if self.fail:
                raise RuntimeError("boom")  # torch's post hook never runs
            return super().step(closure)

    opt = Failing([nn.Parameter(torch.zeros(1))], lr=0.1)
    _at(clock, t + 1)
    with pytest.raises(RuntimeError):
        opt.step()
    for _ in range(2):
        t = _step(rec, clock, clock.now * 1e3)
    rec.resolve()
    Failing.fail = False
    _at(clock, t + 1)
    opt.step()  # 5 ms, timed again
    _step(rec, clock, clock.now * 1e3 - 2)
    got = rec.resolve()
    assert got is not None and got["optimizer"] == pytest.approx(5.0)


def test_a_rank_waiting_for_the_straggler_in_another_collective_is_named_beside_it() -> None:
    # Lightning broadcasts from rank 0 after each step: rank 0 waits there (in "data") for a
    # rank slow in its optimizer step, so both reach the next step late (docs/stragglers.md).
    window = []
    for s in range(10):
        recs = []
        for r in range(8):
            data, optimizer = (52.0 if r == 0 else 2.0), (53.0 if r == 5 else 3.0)
            busy = data + 20.0 + 30.0 + optimizer
            recs.append(RankStep((data, 20.0, 30.0, optimizer, 160.0 - busy)))
        window.append((s, recs))
    named = {(x["rank"], x["phase"]) for x in attribute(window)["stragglers"]}
    assert named == {(0, "data"), (5, "optimizer")}
    three = [(s, [recs[0], recs[1], recs[5]]) for s, recs in window]
    assert attribute(three)["stragglers"] == []  # two of three late: the median rank is late


def test_slots_that_were_not_written_by_one_rank_alone_are_not_reported() -> None:
    width = fields_per_rank(1)
    good = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert len(good) == width
    doubled = [2.0 * v for v in good]  # summed twice: the flag says so
    huge = [1.0, 1e9, 3.0, 4.0, 5.0, 6.0, 7.0]
    got = decode([*good, *doubled, *huge], 3)
    assert got[0] is not None and got[1] is None and got[2] is None
