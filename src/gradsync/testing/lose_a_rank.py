"""One rank lost inside backward, the survivors recover: the run behind the scale checks.

:func:`lose_a_rank` is a rank of ``spawn(..., fresh=True)``: the ranks move onto a counted
TCPStore on loopback (``store_ops.py``), train a tiny float64 model under
:class:`~gradsync.recovery.Recovery`, and one rank SIGKILLs itself inside backward of one
step (or stops itself, SIGSTOP, with ``signal_name="SIGSTOP"``). Each survivor returns what the
checks need: its ``Lost`` record, when every step completed, its store operations by phase,
and its parameters (the checks compare them with one process on the same global batches).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.data import GlobalBatchSampler
from gradsync.ddp import forward
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.failfast import liveness
from gradsync.failfast.liveness import ProcessId
from gradsync.recovery import NoRecoveryError, Recovery, membership
from gradsync.testing.store_ops import Op, gradsyncs, ops_between, tcp_world

SAMPLES_PER_RANK, FEATURES = 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _data(global_batch: int, steps: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(global_batch * steps, FEATURES, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def reference(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """The parameters of one process trained on the same global batches."""
    global_batch = SAMPLES_PER_RANK * world_size
    data, model = _data(global_batch, steps), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = GlobalBatchSampler(data, global_batch, num_replicas=1, rank=0)
    for indices in list(sampler)[:steps]:
        x, y = data[indices]
        (((model(x) - y) ** 2).sum() / len(x)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _train_step(
    step: Any, ddp: DistributedDataParallel, opt: torch.optim.Optimizer, loader: Any
) -> None:
    """The body of ``with step:``: this rank's micro-batches, one optimizer step."""
    for x, y in step.micro_batches(loader):
        loss = ((ddp(x) - y) ** 2).sum()
        ddp.count_items(len(x))
        loss.backward()
    opt.step()
    opt.zero_grad()


def _survivors_meet(store: dist.Store, rank: int, survivors: int) -> None:
    """Without a group: rank 0's process, which holds the store, ends after the others read."""
    store.add("bench/ended", 1)
    give_up = time.monotonic() + 30
    while rank == 0 and store.add("bench/ended", 0) < survivors and time.monotonic() < give_up:
        time.sleep(0.01)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = torch.ones(64, 64)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x / 64)


def _as_if_on_a_host_of_its_own(rank: int) -> None:
    """Make this process's identity (``liveness.this_process``) name a pid space of its own, as
    on another host: no peer can look it up, and it cannot look up theirs."""
    me = liveness.this_process()
    alone = ProcessId(me.pid, me.start, f"simulated-host-{rank}", f"{me.host}-{rank}")
    liveness.this_process = lambda: alone
    membership.this_process = liveness.this_process


def _count_batch_checks() -> list[int]:
    """The first-batch comparisons this process's wrappers will run (one entry each)."""
    calls: list[int] = []
    compare = forward.warn_if_same_batch

    def counted(batch: Any, deadline: Any) -> bool:
        calls.append(1)
        return compare(batch, deadline)

    forward.warn_if_same_batch = counted
    return calls


def _summary(ops: list[Op]) -> dict[str, int]:
    return {"ops": len(ops), "keys": sum(o.keys for o in ops), "bytes": sum(o.nbytes for o in ops)}


def lose_a_rank(
    rank: int, world: int, victim: int, at_step: int, steps: int, options: dict[str, Any]
) -> dict[str, Any]:
    """Train ``steps`` steps; ``victim`` dies inside backward of step ``at_step``.
    ``options``: ``Recovery`` keyword arguments, plus ``signal_name``, ``separate_hosts`` (no
    rank sees another's process, as on hosts of their own) and ``slow_rank`` (a rank that
    computes ``slow_s`` seconds more in every step) and ``count_batch_checks`` (how many times
    this rank's wrapper compared its batches with the others', returned as ``batch_checks``)."""
    options = dict(options)
    batch_checks = _count_batch_checks() if options.pop("count_batch_checks", False) else None
    sig = getattr(signal, options.pop("signal_name", "SIGKILL"))
    slow_rank, slow_s = options.pop("slow_rank", None), options.pop("slow_s", 0.0)
    if options.pop("separate_hosts", False):
        _as_if_on_a_host_of_its_own(rank)
    store = tcp_world(rank, world)
    data = _data(SAMPLES_PER_RANK * world, steps)
    ddp = DistributedDataParallel(_model(), reduction="item_mean", bucket_cap_mb=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    recovery = Recovery(ddp, opt, GlobalBatchSampler(data, SAMPLES_PER_RANK * world), **options)
    started = time.time()
    armed = [False]

    def die(grad: torch.Tensor) -> torch.Tensor:
        if armed[0]:
            armed[0] = False
            store.set("bench/signalled", f"{time.time()!r} {os.getpid()}")
            os.kill(os.getpid(), sig)
        return grad

    ddp.module[0].weight.register_hook(die)  # its gradient comes last in backward
    loader = torch.utils.data.DataLoader(data)
    done: list[tuple[int, int, float]] = []  # (step, generation, when it completed)
    try:
        for step in recovery.steps(steps):
            with step:
                if rank == slow_rank:
                    _busy(slow_s)  # a rank slower than the others (its host loaded, say)
                armed[0] = rank == victim and step.number == at_step
                _train_step(step, ddp, opt, loader)
            if step.completed:
                done.append((step.number, recovery.membership.generation, time.time()))
    except NoRecoveryError as exc:
        raised = time.time()
        at, pid = store.get("bench/signalled").decode().split()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)  # a stopped victim would never end
        _survivors_meet(store, rank, world - 1)
        return {"no_recovery": str(exc), "raised": raised, "signalled": float(at)}
    signalled = float(store.get("bench/signalled").decode().split()[0])
    dist.barrier()  # rank 0's process holds the store: it ends last
    out: dict[str, Any] = {"done": done, "events": recovery.events, "signalled": signalled}
    out["batch_checks"] = None if batch_checks is None else len(batch_checks)
    out["params"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    if recovery.changes:
        out.update(_store_ops(store.ops, recovery.events[0], started))
    return out


def _store_ops(ops: list[Op], event: dict[str, Any], started: float) -> dict[str, Any]:
    """This survivor's store operations in each phase of the recovery ``event``, all of them
    and gradsync's own; those of its other threads (the heartbeat) per second before it."""
    redone = event["regrouped"] + event.get("redone_s", 0.0)
    spans = {
        "roll call": (event["noticed"], event["agreed"]),
        "regroup": (event["agreed"], event["regrouped"]),
        "redo": (event["regrouped"], redone),
    }
    beats = ops_between(ops, started, event["noticed"], main=False)
    return {
        "ops": {k: _summary(ops_between(ops, *span)) for k, span in spans.items()},
        "gradsync_ops": {k: _summary(gradsyncs(ops_between(ops, *s))) for k, s in spans.items()},
        "background_ops_per_s": len(beats) / (event["noticed"] - started),
    }


def beats_stand_still(
    rank: int, world: int, who: int, seconds: float, steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps under ``Recovery``, no rank lost; in step 1 the beating thread of
    rank ``who`` cannot run for ``seconds`` (its lock held, as a starved thread would wait),
    inside backward, while the others wait for its gradients."""
    store = tcp_world(rank, world)
    data = _data(SAMPLES_PER_RANK * world, steps)
    ddp = DistributedDataParallel(_model(), reduction="item_mean", bucket_cap_mb=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    recovery = Recovery(ddp, opt, GlobalBatchSampler(data, SAMPLES_PER_RANK * world))
    armed = [False]

    def stand_still(grad: torch.Tensor) -> torch.Tensor:
        if armed[0]:
            armed[0] = False
            with recovery.heartbeat._lock:
                time.sleep(seconds)
        return grad

    ddp.module[0].weight.register_hook(stand_still)  # its gradient comes last in backward
    loader = torch.utils.data.DataLoader(data)
    for step in recovery.steps(steps):
        with step:
            armed[0] = rank == who and step.number == 1
            _train_step(step, ddp, opt, loader)
    dist.barrier()  # rank 0's process holds the store: it ends last
    del store
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"events": recovery.events, "params": params}
