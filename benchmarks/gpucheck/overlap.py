"""Overlap: bucket collectives run during backward, and what communication is left exposed.

A few steps of a GPT (29M parameters, bf16 autocast, default buckets) under ``torch.profiler``
(CPU and CUDA), for gradsync's default path and its bf16 wire (the step timeline off) and torch
DDP; the Chrome trace of each is read back (:func:`analyse`):

- on the host: how many of a step's ``gradsync::bucket_launch`` ranges begin before its
  ``gradsync::bucket_wait`` (the end-of-backward wait): the buckets launched during backward;
- on the GPU: the step's backward kernels are the compute stream's kernels launched inside the
  ``gpu_check::backward`` range; communication is every NCCL kernel and every copy or kernel on
  another stream in the step (gloo's device-host copies, the wire's side stream). Reported: the
  communication that started before the backward's last kernel ended, its total, and the
  exposed part (from the backward's last kernel to the last communication).

World size 1 on NCCL and 2 gloo ranks on the one GPU; 2 NCCL ranks (and the ZeRO-1 gathers,
which only exist with 2 ranks or more) on a machine with 2 GPUs. Rank 0's traces are kept in
one archive beside the report (``<name>-traces.tar.gz``; open one at https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile, schedule

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss

from .common import ERROR, FAIL, PASS, SKIPPED, Check, Context, device_of, job_error, run_job

LIMIT_S = 90.0
NEEDS_S = 30.0
WAIT, WARMUP, ACTIVE = 1, 2, 3
GPU_MODEL = GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512)
DRY_MODEL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
SETTINGS: dict[str, Any] = {"default": {}, "bf16_wire": {"compression": "bf16"}, "torch_ddp": None,
            "zero1": {}}  # fmt: skip
COMM_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MAX_ARCHIVE_MIB = 15.0


def declare() -> list[Check]:
    what = ("trace of 3 steps: buckets launched before the end-of-backward wait (host); "
            "communication on the GPU that starts before the backward's last kernel, and the "
            "exposed part; torch DDP's beside")  # fmt: skip
    bound = ("all buckets but at most the last launched during backward; on the GPU, where "
             "communication shows (2 gloo ranks: the device-host copies), some of it starts "
             "during backward")  # fmt: skip
    return [
        Check("overlap.default", "overlap: default path", what, bound),
        Check("overlap.bf16_wire", "overlap: bf16 wire", what, bound),
        Check("overlap.nccl2", "overlap on 2 NCCL ranks", "the same with NCCL kernels",
              "NCCL all-reduce kernels start during backward"),
        Check("overlap.zero1_gathers", "ZeRO-1 gathers do not block the host",
              "per step: the host leaves opt.step() before its last all-gather kernel ends",
              "in most steps (the stream waits for the gathers, not the host)"),
    ]  # fmt: skip


def _build(setting: str, cfg: GPTConfig, device: torch.device, dry: bool) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = GPT(cfg).to(device)
    caps: dict[str, Any] = {"bucket_cap_mb": 0.05} if dry else {}
    if setting == "torch_ddp":
        model: Any = TorchDDP(module, **caps)
    else:  # the step timeline off: what it costs is the speed group's to say
        model = gradsync.DistributedDataParallel(
            module, straggler_every=0, **caps, **SETTINGS[setting]
        )
    if setting == "zero1":
        return model, model.shard_optimizer(torch.optim.AdamW, lr=1e-4)
    return model, torch.optim.AdamW(module.parameters(), lr=1e-4)


def trace_settings(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body: each setting traced; rank 0's traces analysed (and kept in spec["dir"])."""
    cuda, dry = spec["cuda"], spec["dry"]
    device = device_of(cuda)
    cfg = DRY_MODEL if dry else GPU_MODEL
    out: dict[str, Any] = {}
    for setting in spec["settings"]:
        path = Path(spec["dir"], f"overlap-{setting}-w{world}-{spec['backend']}-rank{rank}.json")
        try:
            model, opt = _build(setting, cfg, device, dry)
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(0, cfg.vocab_size, (4 if dry else 8, cfg.block_size), generator=g)
            x, y = x.to(device), torch.roll(x, -1, 1).to(device)
            amp = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities,
                         schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
                         on_trace_ready=lambda p, path=path: p.export_chrome_trace(str(path)),
                         ) as prof:  # fmt: skip
                for _ in range(WAIT + WARMUP + ACTIVE):
                    opt.zero_grad()
                    with record_function("gpu_check::forward"), amp:
                        loss = lm_loss(model(x).float(), y)
                    with record_function("gpu_check::backward"):
                        loss.backward()
                    with record_function("gpu_check::optimizer"):
                        opt.step()
                    prof.step()
            if cuda:
                torch.cuda.synchronize()
            if rank == 0:  # kept: run() packs them into one archive beside the report
                out[setting] = analyse(json.loads(path.read_text()))
            else:
                path.unlink()
            del model, opt
        except Exception as exc:
            out[setting] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return out


def analyse(trace: dict[str, Any]) -> dict[str, Any]:
    """Per profiled step (medians over the steps): host launches before the end-of-backward
    wait, and the GPU's backward and communication, in milliseconds."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") != "gpu_user_annotation"]
    steps = sorted((e for e in host if e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])  # fmt: skip
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   and "correlation" in e.get("args", {})}  # fmt: skip
    device_ops = [e for e in events if e.get("cat") in COMM_CATS]
    rows: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]

        def inside(name: str, lo: float = lo, hi: float = hi) -> list[dict[str, Any]]:
            return sorted((e for e in host if e["name"] == name and lo <= e["ts"] < hi),
                          key=lambda e: e["ts"])  # fmt: skip

        backward, optimizer = inside("gpu_check::backward"), inside("gpu_check::optimizer")
        launches, waits = inside("gradsync::bucket_launch"), inside("gradsync::bucket_wait")
        rows["buckets launched"].append(len(launches))
        if waits:
            rows["launched before the end-of-backward wait"].append(
                sum(e["ts"] < waits[0]["ts"] for e in launches)
            )
            rows["host: waiting for buckets (ms)"].append(sum(w["dur"] for w in waits) / 1e3)
        if backward and device_ops:
            _device_rows(rows, backward[0], optimizer, device_ops, launched_at, lo, hi)
    return {key: statistics.median(values) for key, values in rows.items() if values}


def _device_rows(rows: dict[str, list[float]], backward: dict[str, Any], optimizer: list[Any],
                 ops: list[dict[str, Any]], launched_at: dict[Any, float], lo: float,
                 hi: float) -> None:  # fmt: skip
    b_lo, b_hi = backward["ts"], backward["ts"] + backward["dur"]
    mine = [e for e in ops if lo <= launched_at.get(e["args"].get("correlation"), -1) < hi]
    in_backward = [e for e in mine if b_lo <= launched_at[e["args"]["correlation"]] < b_hi]
    busy: dict[Any, float] = defaultdict(float)
    for e in in_backward:
        if e.get("cat") == "kernel" and "nccl" not in e["name"].lower():
            busy[e["args"].get("stream")] += e["dur"]
    if not busy:
        return
    compute = max(busy, key=lambda s: busy[s])
    bwd = [e for e in in_backward if e["args"].get("stream") == compute
           and e.get("cat") == "kernel" and "nccl" not in e["name"].lower()]  # fmt: skip
    bwd_start, bwd_end = min(e["ts"] for e in bwd), max(e["ts"] + e["dur"] for e in bwd)
    comm = [e for e in mine if "nccl" in e["name"].lower() or e["args"].get("stream") != compute]
    rows["GPU backward (ms)"].append((bwd_end - bwd_start) / 1e3)
    rows["GPU communication ops"].append(len(comm))
    rows["GPU communication (ms)"].append(sum(e["dur"] for e in comm) / 1e3)
    rows["GPU communication started during backward"].append(
        sum(bwd_start <= e["ts"] < bwd_end for e in comm)
    )
    ends = [e["ts"] + e["dur"] for e in comm]
    rows["GPU exposed communication (ms)"].append(max([0.0, *(t - bwd_end for t in ends)]) / 1e3)
    gathers = [e for e in mine if "allgather" in e["name"].lower().replace("_", "")]
    if optimizer and gathers:  # ZeRO-1: did the host leave step() before its gathers ended?
        host_left = optimizer[0]["ts"] + optimizer[0]["dur"]
        rows["host left opt.step() before its last gather ended"].append(
            float(host_left < max(e["ts"] + e["dur"] for e in gathers))
        )


def run(ctx: Context, checks: dict[str, Check]) -> None:
    trace_dir = ctx.out / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, Any] = {}
    backend = "nccl" if ctx.cuda else "gloo"
    for name, world, bk in (("world 1", 1, backend), ("2 gloo ranks", 2, "gloo")):
        spec = {"cuda": ctx.cuda, "dry": ctx.dry, "dir": str(trace_dir), "backend": bk,
                "settings": ["default", "bf16_wire", "torch_ddp"]}  # fmt: skip
        try:
            jobs[name] = run_job(ctx, trace_settings, world, (spec,), backend=bk,
                                 limit_s=LIMIT_S / 2)[0]  # fmt: skip
        except Exception as exc:
            jobs[name] = exc
    for setting in ("default", "bf16_wire"):
        judge(checks[f"overlap.{setting}"], setting, jobs, ctx)
    if ctx.needs(checks, ["overlap.nccl2", "overlap.zero1_gathers"], gpus=2):
        _nccl2(ctx, checks, trace_dir)
    archive = Path(shutil.make_archive(str(ctx.out / f"{ctx.name}-traces"), "gztar", trace_dir))
    shutil.rmtree(trace_dir)
    mib = archive.stat().st_size / 2**20
    if mib > MAX_ARCHIVE_MIB:  # a lent machine sends back files of at most 16 MiB
        archive.unlink()
        checks["overlap.default"].measured["traces"] = f"not kept: {mib:.0f} MiB"
    else:
        checks["overlap.default"].measured["traces"] = f"{archive.name} ({mib:.1f} MiB)"


def judge(check: Check, setting: str, jobs: dict[str, Any], ctx: Context) -> None:
    problems, measured = [], {}
    for name, out in jobs.items():
        if isinstance(out, BaseException):
            problems.append(f"{name}: the job failed: {job_error(out)}")
            continue
        got = out[setting]
        measured[name] = got
        measured[f"{name}, torch DDP"] = out["torch_ddp"]
        if "error" in got:
            refused = name == "2 gloo ranks" and ctx.cuda and got["error"].startswith("Usage")
            if not refused:
                problems.append(f"{name}: {got['error']}")
            continue
        n, k = got.get("buckets launched", 0), got.get("launched before the end-of-backward "
                                                       "wait", 0)  # fmt: skip
        if n < 2 or k < n - 1:
            problems.append(f"{name}: {k} of {n} buckets launched during backward")
        if got.get("GPU communication ops", 0) and not got.get(
            "GPU communication started during backward"
        ):
            problems.append(f"{name}: no communication started on the GPU during backward")
    if not ctx.cuda:
        measured["GPU side"] = "skipped: needs CUDA (dry mode has host ranges only)"
    check.finish(FAIL if problems else PASS, "; ".join(problems), **measured)
    if (
        ctx.cuda
        and not problems
        and not any(
            isinstance(o, dict) and o[setting].get("GPU communication ops") for o in jobs.values()
        )
    ):
        check.reason = "no communication op showed on the GPU in either job: host side only"


def _nccl2(ctx: Context, checks: dict[str, Check], trace_dir: Path) -> None:
    spec = {"cuda": True, "dry": False, "dir": str(trace_dir), "backend": "nccl",
            "settings": ["default", "bf16_wire", "torch_ddp", "zero1"]}  # fmt: skip
    try:
        out = run_job(ctx, trace_settings, 2, (spec,), backend="nccl", limit_s=LIMIT_S / 2)[0]
    except Exception as exc:
        for i in ("overlap.nccl2", "overlap.zero1_gathers"):
            checks[i].finish(ERROR, f"the job failed: {job_error(exc)}")
        return
    sub = Check("x", "", "", "")
    judge(sub, "default", {"2 NCCL ranks": out}, ctx)
    bf16 = Check("x", "", "", "")
    judge(bf16, "bf16_wire", {"2 NCCL ranks": out}, ctx)
    bad = [c.reason for c in (sub, bf16) if c.status != PASS]
    checks["overlap.nccl2"].finish(FAIL if bad else PASS, "; ".join(bad),
                                   default=sub.measured, bf16_wire=bf16.measured)  # fmt: skip
    zero = out.get("zero1", {})
    share = zero.get("host left opt.step() before its last gather ended")
    if share is None:
        checks["overlap.zero1_gathers"].finish(
            SKIPPED if "error" not in zero else ERROR, zero.get("error", "no gathers traced")
        )
        return
    checks["overlap.zero1_gathers"].finish(PASS if share >= 0.5 else FAIL, "", **zero)
