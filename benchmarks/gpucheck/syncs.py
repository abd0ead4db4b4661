"""Host syncs: a step makes the host wait for the GPU only where the allow-list says why.

Each setting trains 3 warm-up steps (the first step's checks and plans), then 3 steps under
``torch.cuda.set_sync_debug_mode("error")``: any operation that makes the host wait for the GPU
raises there, naming where it was called from. The reads that stay are allowed by call site
(:data:`ALLOWED`): such a read runs with the mode off for that one call, and is counted; the
count per step is checked against what docs/gpu.md promises. Only reads of a value are
allowed, each at its own call site: any other sync (a pageable host-to-device copy such as
``torch.tensor(values, device="cuda")``, a stream synchronize) raises wherever it is. The mode is
process-wide, so while an allowed read runs with it off, a sync on another thread would pass
unseen (PowerSGD's read runs on its worker during backward): a window of one small copy. torch
DDP's step is checked the same way, as a control of the method (reported, never failed).

In dry mode (CPU, no sync points) the same allow-list gates the stand-in of
``tests/dist/test_host_reads.py``: every read of a tensor's value on the host is counted, and
one from anywhere but an allowed site fails the check.

The other side of not waiting for the GPU: a host buffer that a queued copy still reads must
not be rewritten. ``syncs.tail_in_flight`` writes two records into bucket 0's tail
(``ddp/tail.py``) while a sleeping kernel holds the GPU, with a device-side copy of the tail
queued between them (as the step's all-reduce reads it): that copy must hold the first record.
A pinned staging buffer kept and rewritten on the host would hand it the second.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from gradsync.comm.powersgd import PowerSGDHook
from gradsync.ddp import owners
from gradsync.ddp.checks import readout
from gradsync.ddp.tail import GivenRider, TailLayout

from .common import ERROR, FAIL, MET, MISSED, PASS, Check, Context, device_of, job_error, run_job
from .modes import BY_SLUG, Run

READS = ("tolist", "item", "__float__", "__int__", "__bool__")
WARMUP, MEASURED = 3, 3
LIMIT_S = 60.0
NEEDS_S = 25.0

ALLOWED: dict[str, tuple[Callable[[], CodeType], str]] = {
    "readout": (
        lambda: readout._read.__code__,
        "the step's readout (ddp/checks/readout.py): used flags, step tags, finite flags and "
        "the item total in one copy; the verdicts must hold before optimizer.step(). Not read "
        "at world size 1 without check_finite or item_mean",
    ),
    "optimizer settings check": (
        lambda: _nested(owners.deadline_peers.__code__, "reduce_max"),
        "shard_optimizer()'s step compares three integers across ranks before stepping",
    ),
    "PowerSGD used flags": (
        lambda: PowerSGDHook._reduce.__code__,
        "PowerSGD reads each bucket's used flags on its worker thread between its two "
        "all-reduces (orders that worker's buckets, not the main thread)",
    ),
}


def _nested(code: CodeType, name: str) -> CodeType:
    return next(c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == name)


# (check slug, mode slug, extra wrapper arguments, implementation)
SETTINGS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("default", "default", {}, "gradsync"),
    ("timeline_off", "default", {"straggler_every": 0}, "gradsync"),
    ("bf16_wire", "bf16_wire", {}, "gradsync"),
    ("fp16_wire", "fp16_wire", {}, "gradsync"),
    ("powersgd", "powersgd", {}, "gradsync"),
    ("torch_hook", "torch_hook", {}, "gradsync"),
    ("main_grads", "main_grads", {}, "gradsync"),
    ("zero1", "zero1", {}, "gradsync"),
    ("check_finite", "check_finite", {}, "gradsync"),
    ("item_mean", "item_mean", {}, "gradsync"),
    ("side_stream", "side_default", {}, "gradsync"),
    ("torch_ddp", "default", {}, "torch"),
)


def expected(slug: str, world: int, num_buckets: int) -> dict[str, int]:
    """The allowed reads per step that docs/gpu.md promises (at most)."""
    if slug == "torch_ddp":
        return {}
    out = {"readout": 1} if world > 1 or slug in ("check_finite", "item_mean") else {}
    if slug == "zero1":
        out["optimizer settings check"] = 1
    if slug == "powersgd":
        out["PowerSGD used flags"] = num_buckets
    return out


def declare() -> list[Check]:
    checks = []
    for slug, mode, extra, impl in SETTINGS:
        what = "torch DDP (the control)" if impl == "torch" else BY_SLUG[mode].name + (
            f", {extra}" if extra else "")  # fmt: skip
        checks.append(Check(
            f"syncs.{slug}", f"host syncs: {what}",
            f"{MEASURED} steps after {WARMUP} under set_sync_debug_mode('error') at world size "
            "1 (NCCL): syncs outside the allow-list, and the allowed ones per step",
            "no sync outside the allow-list; allowed reads per step at most: "
            + (", ".join(f"{k} {v}" for k, v in expected(slug, 1, 0).items()) or "none")
            + (" (PowerSGD: one per bucket)" if slug == "powersgd" else ""),
            target=impl == "torch",  # the control: a sync of torch's own is no fault of ours
        ))  # fmt: skip
    checks.append(Check(
        "syncs.tail_in_flight", "bucket 0's tail rewritten while its last copy is queued",
        "two records written to the tail while a sleeping kernel holds the GPU, a device-side "
        "copy of the tail queued between them",
        "the queued copy holds the first record, the tail the second, and the GPU was still "
        "held when the host had written both (else the check shows nothing)",
    ))  # fmt: skip
    checks.append(Check(
        "syncs.nccl2", "host syncs on 2 NCCL ranks",
        "the same settings at world size 2 on NCCL", "the readout once per step, as above",
    ))  # fmt: skip
    return checks


class ReadGate:
    """Patches the host reads of tensors: one from an allowed site runs with the sync debug
    mode off and is counted by site; any other is left to the mode (GPU), or recorded (CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.sites = {get(): site for site, (get, _) in ALLOWED.items()}
        self.counts: Counter[str] = Counter()
        self.unlisted: list[str] = []
        self.measuring = False
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self) -> ReadGate:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._gate(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)

    def _gate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any) -> Any:
            frame = sys._getframe(1)
            site = self.sites.get(frame.f_code)
            if not self.measuring:
                return original(tensor, *args)
            if site is None:
                if not self.cuda:  # the CPU stand-in: every read counts
                    self.unlisted.append(f"{frame.f_code.co_filename.split('src/')[-1]}:"
                                         f"{frame.f_lineno} {frame.f_code.co_name}")  # fmt: skip
                return original(tensor, *args)
            self.counts[site] += 1
            if not self.cuda:
                return original(tensor, *args)
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original(tensor, *args)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        return read

    def measure(self, on: bool) -> None:
        self.measuring = on
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error" if on else 0)


def sync_settings(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body: each setting's allowed reads per step, unlisted reads, or its error."""
    cuda = spec["cuda"]
    device = device_of(cuda)
    out = {}
    for slug, mode, extra, impl in SETTINGS:
        try:
            run = Run(BY_SLUG[mode], impl, rank, world, device, extra=extra or None)
            buckets = run.model.num_buckets if impl == "gradsync" else 0
            with ReadGate(cuda) as gate:
                for _ in range(WARMUP):
                    run.step()
                run.prefetch(MEASURED)
                gate.measure(True)
                try:
                    for _ in range(MEASURED):
                        run.step()
                finally:
                    gate.measure(False)
                if cuda:
                    torch.cuda.synchronize()
            out[slug] = {"per step": {k: v / MEASURED for k, v in gate.counts.items()},
                         "unlisted": sorted(set(gate.unlisted)), "buckets": buckets}  # fmt: skip
            run.close()
        except Exception as exc:
            out[slug] = {"error": _where(exc)}
        gc.collect()
    try:
        out["tail_in_flight"] = tail_in_flight(device)
    except Exception as exc:
        out["tail_in_flight"] = {"error": _where(exc)}
    return out


FIRST, SECOND = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
HOLD_CYCLES = 200_000_000
"""``torch.cuda._sleep`` cycles that hold the GPU while the host writes: about 0.1 s."""


def tail_in_flight(device: torch.device) -> dict[str, Any]:
    """What a device-side copy queued between two writes of bucket 0's tail saw."""
    layout = TailLayout(world_size=2, rank=0, riders=[GivenRider("record", len(FIRST))])
    tail = torch.zeros(layout.numel, device=device)
    cuda = device.type == "cuda"
    held = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        held = torch.cuda.Event()
        held.record()
    layout.write(tail, {"record": FIRST})
    seen = tail.clone()  # queued behind the sleep, as bucket 0's all-reduce would be
    layout.write(tail, {"record": SECOND})
    still_held = held is not None and not held.query()
    if cuda:
        torch.cuda.synchronize()
    return {"queued copy saw": seen[: len(FIRST)].tolist(),
            "tail at the end": tail[: len(SECOND)].tolist(),
            "GPU still held after both writes": still_held if cuda else "CPU (dry)"}  # fmt: skip


def _judge_tail(check: Check, got: dict[str, Any], cuda: bool) -> None:
    if "error" in got:
        check.finish(ERROR, f"it raised: {got['error']}")
        return
    problems = []
    if got["queued copy saw"] != FIRST:
        problems.append(f"the queued copy saw {got['queued copy saw']}, not the first record")
    if got["tail at the end"] != SECOND:
        problems.append(f"the tail ended as {got['tail at the end']}, not the second record")
    if problems:
        check.finish(FAIL, "; ".join(problems), **got)
    elif cuda and got["GPU still held after both writes"] is not True:
        check.finish(ERROR, "the GPU was no longer held when the host had written both "
                     "records: the check showed nothing", **got)  # fmt: skip
    else:
        check.finish(PASS, "" if cuda else "copies are synchronous on the CPU", **got)


def _where(exc: BaseException) -> str:
    """The error and the innermost frames of gradsync (or of this check) that led to it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "gradsync" in f.filename or "gpucheck" in f.filename][-3:]  # fmt: skip
    at = "; ".join(f"{f.filename.split('src/')[-1]}:{f.lineno} {f.name}" for f in frames)
    cause = f" (cause: {_where(exc.__cause__)})" if exc.__cause__ is not None else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]} at {at}{cause}"


def run(ctx: Context, checks: dict[str, Check]) -> None:
    backend = "nccl" if ctx.cuda else "gloo"
    try:
        out = run_job(ctx, sync_settings, 1, ({"cuda": ctx.cuda},), backend=backend,
                      limit_s=LIMIT_S)[0]  # fmt: skip
    except Exception as exc:
        for check in checks.values():
            check.finish(ERROR, f"the job failed: {job_error(exc)}")
        return
    for slug, *_ in SETTINGS:
        judge(checks[f"syncs.{slug}"], slug, out[slug], 1)
    _judge_tail(checks["syncs.tail_in_flight"], out["tail_in_flight"], ctx.cuda)
    if ctx.needs(checks, ["syncs.nccl2"], gpus=2):
        try:
            out2 = run_job(ctx, sync_settings, 2, ({"cuda": True},), backend="nccl",
                           limit_s=LIMIT_S)[0]  # fmt: skip
        except Exception as exc:
            checks["syncs.nccl2"].finish(ERROR, f"the job failed: {job_error(exc)}")
            return
        sub = {slug: Check(slug, "", "", "", target=impl == "torch")
               for slug, _, _, impl in SETTINGS}  # fmt: skip
        for slug, check in sub.items():
            judge(check, slug, out2[slug], 2)
        bad = [f"{s}: {c.reason}" for s, c in sub.items() if c.status == FAIL]
        checks["syncs.nccl2"].finish(FAIL if bad else PASS, "; ".join(bad),
                                     **{s: c.measured for s, c in sub.items()})  # fmt: skip


def judge(check: Check, slug: str, got: dict[str, Any], world: int) -> None:
    if "error" in got:
        check.finish(MISSED if check.target else FAIL, f"a step raised: {got['error']}")
        return
    allowed = expected(slug, world, got["buckets"])
    over = [f"{site} {n:g} per step (at most {allowed.get(site, 0)})"
            for site, n in got["per step"].items() if n > allowed.get(site, 0)]  # fmt: skip
    measured = {"allowed reads per step": got["per step"] or "none",
                "why they stay": {s: ALLOWED[s][1] for s in got["per step"]} or "-"}  # fmt: skip
    if got["unlisted"]:
        measured["reads outside the allow-list (CPU stand-in)"] = got["unlisted"]
        over.append(f"reads outside the allow-list at {', '.join(got['unlisted'])}")
    if check.target:  # torch DDP, the control of the method: reported, never failed
        check.finish(MISSED if over else MET, "; ".join(over), **measured)
        return
    check.finish(FAIL if over else PASS, "; ".join(over), **measured)
