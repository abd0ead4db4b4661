"""The NCCL deadline: a GPU that never gets past a step's collectives is named within
gradsync's ``timeout``, before torch's NCCL watchdog (10 minutes) kills the process.

One GPU: world size 1 on NCCL, the wrapper's deadline (``new_wrapper_deadline``, the object the
reducer waits with) polls a real CUDA event. First an event the GPU reaches in a quarter of the
timeout (waited for, no error), then one queued behind a kernel that holds the GPU for twice the
timeout: ``CollectiveTimeoutError`` must come within the timeout plus a second, and the process
and its NCCL group must still work afterwards. (The reducer itself polls only at world size 2
and more: with one rank nothing can be missing.) Dry mode drives the same method with the
stand-in event of ``tests/dist/test_device_deadline.py``.

Two GPUs: a real job in which rank 1 never runs step 1; rank 0 must raise naming rank 1.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradsync
from gradsync.errors import CollectiveTimeoutError
from gradsync.failfast.deadline import new_wrapper_deadline
from gradsync.testing.events import FakeEvent
from gradsync.testing.gpt import lm_loss

from .common import ERROR, FAIL, PASS, SMALL, Check, Context, batch, device_of, job_error, run_job

LIMIT_S = 40.0
NEEDS_S = 15.0
TIMEOUT_S = {True: 2.0, False: 1.0}  # the deadline on the GPU, and in dry mode
WHAT = "the gradient reduction of step 0"


def declare() -> list[Check]:
    return [
        Check(
            "deadline.device_event", "the CUDA-event deadline at world size 1",
            "Deadline.wait_device on a CUDA event the GPU reaches in time, then on one held "
            "past the timeout by a sleeping kernel",
            "the first waited for without error; the second raises CollectiveTimeoutError "
            "within timeout + 1 s (timeout 2 s); an NCCL all-reduce works afterwards",
        ),
        Check(
            "deadline.nccl_missing_rank", "a rank that never arrives, on 2 NCCL ranks",
            "rank 1 skips step 1; seconds until rank 0 raises, and what it says",
            "CollectiveTimeoutError naming rank 1 within timeout + 3 s (timeout 5 s), far "
            "before the NCCL watchdog",
        ),
    ]  # fmt: skip


def _held_event(seconds: float, cycles_per_s: float) -> Any:
    torch.cuda._sleep(int(seconds * cycles_per_s))
    event = torch.cuda.Event()
    event.record()
    return event


def _cycles_per_s() -> float:
    """What ``torch.cuda._sleep`` spins per second on this GPU (it counts clock cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


def device_event(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body (world size 1)."""
    cuda = spec["cuda"]
    limit = TIMEOUT_S[cuda]
    device = device_of(cuda)
    rate = _cycles_per_s() if cuda else 0.0
    deadline = new_wrapper_deadline(None, timedelta(seconds=limit), device)
    deadline.begin(WHAT)
    out: dict[str, Any] = {"cycles per ms": rate / 1e3}
    t0 = time.monotonic()
    deadline.wait_device(_held_event(limit / 4, rate) if cuda else FakeEvent(50), WHAT)
    out["in-time event waited (s)"] = time.monotonic() - t0
    held = _held_event(2 * limit, rate) if cuda else FakeEvent(None)
    t0 = time.monotonic()
    try:
        deadline.wait_device(held, WHAT)
        out["raised"] = "nothing"
    except CollectiveTimeoutError as exc:
        out["raised"] = f"CollectiveTimeoutError: {exc}"
    out["seconds until it raised"] = time.monotonic() - t0
    if cuda:
        torch.cuda.synchronize()
        t = torch.ones(4, device=device)
        dist.all_reduce(t)  # the process and its NCCL group still work
        out["NCCL all-reduce afterwards"] = t.tolist() == [1.0] * 4
    return out


def run(ctx: Context, checks: dict[str, Check]) -> None:
    check = checks["deadline.device_event"]
    try:
        out = run_job(ctx, device_event, 1, ({"cuda": ctx.cuda},),
                      backend="nccl" if ctx.cuda else "gloo", limit_s=LIMIT_S)[0]  # fmt: skip
    except Exception as exc:
        check.finish(ERROR, f"the job failed: {job_error(exc)}")
    else:
        limit = TIMEOUT_S[ctx.cuda]
        took = out["seconds until it raised"]
        problems = []
        if not out["raised"].startswith("CollectiveTimeoutError"):
            problems.append(f"the held event raised {out['raised']}")
        elif f"gave up waiting for {WHAT}" not in out["raised"]:
            problems.append("the error does not say what it waited for")
        if not limit <= took < limit + 1.0:
            problems.append(f"it raised after {took:.2f} s (timeout {limit:g} s)")
        if out.get("NCCL all-reduce afterwards") is False:
            problems.append("the NCCL group did not work afterwards")
        out["raised"] = out["raised"][:300]
        check.finish(FAIL if problems else PASS, "; ".join(problems), **out,
                     stand_in="a real CUDA event held by a sleeping kernel" if ctx.cuda else
                     "FakeEvent on CPU (dry)")  # fmt: skip
    if ctx.needs(checks, ["deadline.nccl_missing_rank"], gpus=2):
        _missing_rank(ctx, checks["deadline.nccl_missing_rank"])


MISSING_TIMEOUT_S = 5.0


def missing_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """Rank body (2 NCCL ranks): rank 1 never runs step 1. Each rank writes what it saw to
    ``spec["out"]``, then both leave at once: rank 0's NCCL all-reduce can never finish, and an
    orderly exit would wait for it."""
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    device = device_of(True)
    model = gradsync.DistributedDataParallel(
        torch.nn.Linear(SMALL.n_embd, SMALL.vocab_size).to(device), timeout=MISSING_TIMEOUT_S
    )
    out: dict[str, Any] = {}
    for step in range(2):
        if rank == 1 and step == 1:
            break  # busy elsewhere: never joins step 1's collectives
        x, y = batch(step, rank, world, device)
        emb = torch.nn.functional.one_hot(x, SMALL.n_embd).float()
        t0 = time.monotonic()
        try:
            lm_loss(model(emb), y).backward()
        except CollectiveTimeoutError as exc:
            out = {"raised": str(exc)[:400], "seconds": time.monotonic() - t0, "step": step}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier(group=side)
    os._exit(0)


def _missing_rank(ctx: Context, check: Check) -> None:
    note = "the ranks exited normally"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_job(ctx, missing_rank, 2, ({"out": tmp},), backend="nccl", limit_s=LIMIT_S,
                    pg_timeout_s=600.0)  # fmt: skip
        except Exception as exc:  # the ranks leave through os._exit: expected
            note = job_error(exc)
        path = Path(tmp, "rank0.json")
        if not path.exists():
            check.finish(ERROR, f"rank 0 reported nothing ({note})")
            return
        got = json.loads(path.read_text())
    took = got.get("seconds", float("inf"))
    ok = "rank 1" in got.get("raised", "") and took < MISSING_TIMEOUT_S + 3.0
    check.finish(PASS if ok else FAIL, "" if ok else "rank 0 did not name rank 1 in time", **got)
