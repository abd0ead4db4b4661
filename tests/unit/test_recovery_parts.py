"""The parts of in-process recovery that one process can check: one membership however the
survivors' views differ, the record of optimizer steps and the replay that skips one, the
step-start snapshot, the refusals,
and the sliced wait that lets a survivor give up once a regroup has begun."""

from __future__ import annotations

import subprocess
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.failfast import liveness
from gradsync.failfast.liveness import ProcessId, process_state, this_process
from gradsync.failfast.waiting import wait_watching
from gradsync.optim import mirror
from gradsync.optim.mirror import same_bits
from gradsync.recovery import Membership, NoRecoveryError, RankExcludedError, Recovery, Report, heal
from gradsync.recovery.membership import agree, publish_process
from gradsync.recovery.replicas import check_whole, survivors_layout
from gradsync.recovery.rollback import OptimizerSteps, StepStart, holder_of


def _agree_all(store: dist.Store, reports: dict[int, Report], windows: dict[int, float]) -> dict:
    """Run agree() for each rank in ``reports`` on its own thread; rank -> result or error."""
    current = Membership(0, (0, 1, 2), 0, {})  # no process published: as on another host
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        me = Membership(0, current.members, rank, {})
        try:
            out[rank] = agree(store, "s", me, reports[rank], windows[rank])
        except Exception as exc:  # noqa: BLE001
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in reports]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_survivors_that_answer_agree_on_one_membership_and_new_ranks() -> None:
    store = dist.HashStore()
    five, six = Report(5, "backward"), Report(6, "forward")
    out = _agree_all(store, {0: five, 2: six}, {0: 0.5, 2: 0.5})
    (m0, lost0), (m2, lost2) = out[0], out[2]  # type: ignore[misc]
    assert m0.members == m2.members == (0, 2)
    assert (m0.rank, m2.rank, m0.generation, m0.world_size) == (0, 1, 1, 2)
    assert m0.reports == m2.reports == {0: five, 2: six} and set(lost0) == set(lost2) == {1}


def test_a_survivor_that_answers_after_the_decision_is_left_out_not_split_off() -> None:
    """Rank 0 decides alone after a short window; rank 2, slower to answer, must not go on
    with a group of its own: it reads the decision and is told it was left out."""
    store = dist.HashStore()
    out = _agree_all(store, {0: Report(5, "forward")}, {0: 0.05})
    membership, _ = out[0]  # type: ignore[misc]
    assert membership.members == (0,)
    late = _agree_all(store, {2: Report(5, "forward")}, {2: 0.05})[2]
    assert isinstance(late, RankExcludedError) and "answered after the others" in str(late)


def test_a_silent_rank_seen_alive_on_this_host_sends_everyone_to_the_restart_path() -> None:
    store = dist.HashStore()
    me = Membership(0, (0, 1), 0, {})
    publish_process(store, "s", 1)  # rank 1 "is" this very process: running, and silent
    with pytest.raises(NoRecoveryError, match=r"alive but did not answer \(rank 1: its process"):
        agree(store, "s", me, Report(1, "forward"), 0.05)


def _adam_and_params() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    return layer, torch.optim.AdamW(layer.parameters(), lr=0.1)


def _step(layer: nn.Linear, opt: torch.optim.Optimizer) -> None:
    layer(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_the_optimizer_steps_are_recorded_without_a_copy_and_a_second_one_is_refused() -> None:
    layer, opt = _adam_and_params()
    steps = OptimizerSteps(opt)
    steps.begin(0)
    _step(layer, opt)
    assert steps.stepped_in == 0
    with pytest.raises(gradsync.UsageError, match="stepped twice in step 0"):
        _step(layer, opt)
    steps.begin(1)
    assert steps.stepped_in == 0  # step 1 has not stepped yet
    _step(layer, opt)
    assert steps.stepped_in == 1
    steps.begin(2)  # a save at the step's start: DCP steps a stateless optimizer at lr 0
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1)
    sgd_steps = OptimizerSteps(sgd)
    sgd_steps.begin(2)
    get_optimizer_state_dict(layer, sgd)
    _step(layer, sgd)  # the loop's step: not refused as a second one
    assert sgd_steps.stepped_in == 2
    steps.end()  # between steps the loop may step as it likes: nothing recorded or refused
    _step(layer, opt)
    _step(layer, opt)
    assert steps.stepped_in == 1


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_a_replayed_step_skips_only_its_optimizer_step_even_through_a_scheduler() -> None:
    layer, opt = _adam_and_params()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step
    wrapped = vars(opt)["step"]
    steps = OptimizerSteps(opt)
    steps.begin(0)
    _step(layer, opt)
    sched.step()
    after = [p.detach().clone() for p in layer.parameters()]
    state = opt.state[layer.weight]["exp_avg"].clone()
    steps.replay = 0
    steps.begin(0)  # the step again, its result already in the parameters
    _step(layer, opt)
    sched.step()
    assert all(torch.equal(p, a) for p, a in zip(layer.parameters(), after, strict=True))
    assert torch.equal(opt.state[layer.weight]["exp_avg"], state)
    assert opt.param_groups[0]["lr"] == 0.025  # the scheduler stepped both times
    steps.begin(1)  # the replay is over: the scheduler's own wrapper is back, and steps
    assert vars(opt)["step"] is wrapped
    _step(layer, opt)
    assert not torch.equal(layer.weight, after[0]) and steps.stepped_in == 1
    steps.replay = 2
    steps.begin(2)
    steps.remove()  # a replay cut short by the end of the loop leaves the optimizer whole
    assert vars(opt)["step"] is wrapped


def test_the_holder_of_a_steps_result_is_the_first_survivor_that_stepped_in_it() -> None:
    reports = {0: Report(4, "backward", 3), 2: Report(5, "forward", 4), 3: Report(4, "x", 4)}
    assert holder_of(4, reports, (0, 2, 3)) == 1  # new rank 1: old rank 2
    assert holder_of(4, {0: reports[0]}, (0,)) is None  # nobody stepped in 4: redo as it is
    with pytest.raises(NoRecoveryError, match=r"rank\(s\) \[2, 3\] stepped their optimizer past"):
        holder_of(3, reports, (0, 2, 3))


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_the_step_start_puts_back_the_schedule_the_rates_buffers_and_position() -> None:
    layer, opt = _adam_and_params()
    layer.register_buffer("count", torch.zeros(1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = GlobalBatchSampler(range(20), 4, num_replicas=1, rank=0)
    start = StepStart.take(layer, opt, sched, sampler)
    sampler.step = 3
    layer.count += 1
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    start.restore(layer, opt, sched, sampler)
    assert opt.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0
    assert sampler.step == 0 and layer.count.item() == 0


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"reduction": "mean"}, 'reduction="item_mean"'), ({"compression": "bf16"}, "compression")],
)
def test_recovery_refuses_settings_it_cannot_redo_exactly(kwargs: dict, match: str) -> None:
    model = gradsync.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradsync.UsageError, match=match):
        Recovery(model, opt, GlobalBatchSampler(range(8), 4))


@pytest.mark.parametrize("prefixed", [False, True])
def test_outside_torchrun_a_tcp_store_gives_the_address_a_replacement_joins_at(
    prefixed: bool,
) -> None:
    """``init_process_group(store=...)`` or ``env://`` under another launcher: the job's store
    is the default group's TCPStore, and a replacement's client at ``store_address`` sees the
    keys the job reads (a ticket it takes is waiting for the job)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore("launcher/", server) if prefixed else server
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = gradsync.DistributedDataParallel(nn.Linear(2, 2), reduction="item_mean")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recovery = Recovery(model, opt, GlobalBatchSampler(range(8), 4, num_replicas=1, rank=0))
        assert recovery.store_address == f"127.0.0.1:{server.port}"
        host, port = recovery.store_address.rsplit(":", 1)
        replacement = dist.TCPStore(host, int(port), is_master=False)
        ticket = heal.ask(replacement)
        assert heal.waiting(recovery.store) == (ticket,)
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_a_file_store_has_no_address_to_join_at() -> None:
    model = gradsync.DistributedDataParallel(nn.Linear(2, 2), reduction="item_mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = Recovery(model, opt, GlobalBatchSampler(range(8), 4, num_replicas=1, rank=0))
    assert recovery.store_address is None


@pytest.mark.usefixtures("one_rank")
def test_recovery_covers_zero1_through_the_wrapper_only_and_no_replacement_joins_it() -> None:
    model = gradsync.DistributedDataParallel(nn.Linear(2, 2), reduction="item_mean")
    alone = gradsync.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(gradsync.UsageError, match=r"through model.shard_optimizer\(...\) only"):
        Recovery(model, alone, GlobalBatchSampler(range(8), 4))
    opt = model.shard_optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(gradsync.UsageError, match="a replacement cannot join a ZeRO-1 job"):
        Recovery(model, opt, GlobalBatchSampler(range(8), 4), join="127.0.0.1:1")
    Recovery(model, opt, GlobalBatchSampler(range(8), 4))  # one rank: nothing to mirror


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numpy", [True, False])
def test_a_mirror_is_compared_with_its_owner_bit_for_bit(
    dtype: torch.dtype, numpy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN both stepped to is no divergence (torch.equal says it is), a zero of the other
    sign is one (torch.equal says it is not), and so is one element's last bit; with numpy or
    without it."""
    if not numpy:
        monkeypatch.setattr(mirror, "np", None)
    owner = torch.tensor([1.0, float("nan"), 0.0, 3.0]).to(dtype)
    assert same_bits(owner, owner.clone())
    other_sign = owner.clone()
    other_sign[2] = -0.0
    assert not same_bits(owner, other_sign)
    last_bit = owner.clone()
    last_bit.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[dtype.itemsize])[3] ^= 1
    assert not same_bits(owner, last_bit)


class _Collective:
    """A collective in flight: completes (or fails with ``error``) after ``slices`` timed-out
    waits, just after the last of them raised, as a gloo work can between ``wait(timeout)``'s
    check and the caller's next look."""

    def __init__(self, slices: int, error: RuntimeError | None = None) -> None:
        self.slices, self.error, self.waits = slices, error, 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if timeout is not None and self.waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.waits >= self.slices


class _Watch:
    def __init__(self, begun: bool) -> None:
        self.answer = begun

    def begun(self) -> bool:
        return self.answer


def test_a_collective_done_as_its_slice_ran_out_is_no_failure() -> None:
    # Taken for a failure, this started a regroup in which no rank was lost.
    wait_watching(_Collective(slices=3), _Watch(False), timedelta(seconds=10))


def test_a_sliced_wait_raises_the_collectives_own_error_or_gives_up_on_a_regroup() -> None:
    lost = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_watching(_Collective(slices=2, error=lost), _Watch(False), timedelta(seconds=10))
    with pytest.raises(RuntimeError, match="began to regroup"):
        wait_watching(_Collective(slices=10**6), _Watch(True), timedelta(seconds=10))
    with pytest.raises(RuntimeError, match="timed out"):
        wait_watching(_Collective(slices=10**6), _Watch(False), timedelta(seconds=0.2))


def test_a_process_that_exits_while_its_stat_is_read_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reading /proc/<pid>/stat of a process that exits meanwhile fails with ESRCH, not ENOENT:
    # the roll call of a survivor that looked just then raised instead of finding it gone.
    child = subprocess.Popen(["true"])
    child.wait()
    me = this_process()
    gone = ProcessId(child.pid, 1, me.space, me.host)

    def exiting(self: object, *args: object, **kwargs: object) -> str:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(liveness.Path, "read_text", exiting)
    assert process_state(gone) == "gone"


@pytest.mark.usefixtures("one_rank")
def test_recovery_on_a_mesh_splits_over_replicas_and_refuses_what_it_cannot_rebuild() -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = gradsync.DistributedDataParallel(
        nn.Linear(2, 2), device_mesh=mesh["dp"], reduction="item_mean"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = Recovery(model, opt, GlobalBatchSampler(range(8), 4, num_replicas=1, rank=0))
    assert recovery.replicas.axis == "dp" and not recovery.replicas.commits
    with pytest.raises(gradsync.UsageError, match=r"replicas of mesh axis 'dp'.*num_replicas=1"):
        Recovery(model, opt, GlobalBatchSampler(range(8), 4, num_replicas=2, rank=1))
    with pytest.raises(gradsync.UsageError, match="covers neither a replacement joining"):
        Recovery(model, opt, GlobalBatchSampler(range(8), 4), join="127.0.0.1:1")
    zero = gradsync.DistributedDataParallel(
        nn.Linear(2, 2), device_mesh=mesh["dp"], reduction="item_mean"
    )
    flat = gradsync.DistributedDataParallel(
        nn.Linear(2, 2), device_mesh=mesh["dp", "tp"]._flatten(), reduction="item_mean"
    )
    with pytest.raises(gradsync.UsageError, match="not the flattened 'dp_tp'"):
        Recovery(flat, opt, GlobalBatchSampler(range(8), 4))
    with pytest.raises(gradsync.UsageError, match="nor ZeRO-1"):
        Recovery(
            zero, zero.shard_optimizer(torch.optim.SGD, lr=0.1), GlobalBatchSampler(range(8), 4)
        )
    own = gradsync.DistributedDataParallel(
        nn.Linear(2, 2), process_group=dist.new_group([0]), reduction="item_mean"
    )
    with pytest.raises(gradsync.UsageError, match="not over a process group of its own"):
        Recovery(own, opt, GlobalBatchSampler(range(8), 4))


def test_a_mesh_goes_on_without_whole_replicas_on_any_axis_and_renumbers_the_rest() -> None:
    # (tp 2, dp 3), dp the inner axis: replica dp=1 is ranks 1 and 4, spread over the nodes
    ranks = torch.arange(6).reshape(2, 3)
    check_whole(ranks, 1, "dp", {1, 4})
    with pytest.raises(NoRecoveryError, match=r"lost rank\(s\) \[1\] of replica dp=1 \(ranks "
                       r"\[1, 4\]\) but not rank\(s\) \[4\]"):  # fmt: skip
        check_whole(ranks, 1, "dp", {1})
    assert survivors_layout(ranks, 1, (0, 2, 3, 5)).tolist() == [[0, 1], [2, 3]]
    # (dp 3, tp 2): replica 0 lost, the ranks after it move down
    assert survivors_layout(ranks.reshape(3, 2), 0, (2, 3, 4, 5)).tolist() == [[0, 1], [2, 3]]


def test_a_replacement_node_is_offered_once_all_its_ranks_have_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two local ranks of one replacement torchrun ask a moment apart: no offer until both
    have (one membership change, not two); a process outside torchrun is a node of its own."""
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "replacement-a")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    first = heal.ask(store)
    assert heal.waiting(store) == ()
    second = heal.ask(store)
    assert heal.waiting(store) == (first, second)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    third = heal.ask(store)
    assert heal.waiting(store) == (first, second, third)
