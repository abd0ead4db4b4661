"""Step time at world size 1 on NCCL: gradsync against torch DDP (target <= torch + 2 %), and the
step timeline on against off (target <= 1 %), eager and ``torch.compile``d.

The model is the main job's GPT scaled to fill an H100: 12 layers, 768 wide, vocabulary 32768,
sequences of 1024, 124M parameters, bf16 autocast, AdamW, 8 sequences a step (about 30 ms on an
H100). The three variants live in one process and are timed in interleaved rounds
(``gradsync.bench.steptime.time_interleaved``: the order rotates every round, each call ends
with a device sync), ``STEPS`` steps a call; reported are the medians, their ratio, and the
median and quartiles of the per-round ratios (each round's variants share that round's noise).

Compiled: ``torch.compile(wrapper)``, so that DDPOptimizer splits the graph at the buckets
(docs/compile.md); both wrappers get 25 MiB buckets there, so their pieces are the same and
inductor compiles them once. Each variant's GPT gets its own copy of ``GPT.forward``'s code, as
in ``benchmarks/compile_step_time.py``: dynamo would otherwise reuse the first variant's graph.
"""

from __future__ import annotations

import gc
import statistics
import time
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.bench.steptime import time_interleaved
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.timing import PHASES

from .common import (
    ERROR,
    FAIL,
    MET,
    MISSED,
    PASS,
    SKIPPED,
    Check,
    Context,
    device_of,
    job_error,
    run_job,
)

LIMIT_S = {"eager": 100.0, "compiled": 260.0}
NEEDS_S = 60.0
GPU_MODEL = GPTConfig(vocab_size=32768, block_size=1024, n_layer=12, n_head=12, n_embd=768)
DRY_MODEL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
TORCH, ON, OFF = "torch DDP", "gradsync, timeline on", "gradsync, timeline off"
PAIRS = {"vs_torch": (ON, TORCH, 1.02), "timeline": (ON, OFF, 1.01)}
STEPS, WARMUP, ROUNDS = 3, 3, 20  # on the GPU; dry: 1, 1, 2


def declare() -> list[Check]:
    checks = []
    for how in ("eager", "compiled"):
        checks.append(Check(
            f"speed.{how}.vs_torch", f"step time, {how}: gradsync vs torch DDP",
            "median step of gradsync (defaults, timeline on) / torch DDP (defaults), world "
            "size 1, GPT 124M bf16 autocast, interleaved rounds",
            "target <= 1.02", target=True,
        ))  # fmt: skip
        checks.append(Check(
            f"speed.{how}.timeline", f"step time, {how}: step timeline on vs off",
            "median step with straggler_every=10 / with straggler_every=0, same run",
            "target <= 1.01", target=True,
        ))  # fmt: skip
    checks.append(Check(
        "speed.timeline_phases", "the step timeline's CUDA-event phases",
        "after the timed rounds, 12 steps of the timeline-on variant alone, each ended by a "
        "device sync: the timeline's interval (GPU time between two steps' ends, from CUDA "
        "events) vs the host's time per step; its phases",
        "interval within 15 % of the measured step; forward and backward phases > 0, backward "
        "> forward (on the GPU; dry mode reports the host clock's figures only)",
    ))  # fmt: skip
    return checks


def _variant(name: str, cfg: GPTConfig, device: torch.device, compiled: str | None) -> Any:
    """(model to call, optimizer) of variant ``name``; ``compiled``: the torch.compile
    backend, or None for eager."""
    torch.manual_seed(0)
    if compiled:  # a forward of its own: see the module's docstring
        forward = types.FunctionType(GPT.forward.__code__.replace(), GPT.forward.__globals__)
        module: Any = type("GPT", (GPT,), {"forward": forward})(cfg).to(device)
    else:
        module = GPT(cfg).to(device)
    caps: dict[str, Any] = {"bucket_cap_mb": 25.0} if compiled else {}
    if name == TORCH:
        model: Any = TorchDDP(module, **caps)
    else:
        model = gradsync.DistributedDataParallel(
            module, straggler_every=10 if name == ON else 0, **caps
        )
    if compiled:
        model = torch.compile(model, backend=compiled)
    return model, torch.optim.AdamW(module.parameters(), lr=1e-4)


def step_times(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body: per variant, the seconds per step of every timed round (or its error)."""
    cuda, dry = spec["cuda"], spec["dry"]
    device = device_of(cuda)
    cfg = DRY_MODEL if dry else GPU_MODEL
    steps, warmup, rounds = (1, 1, 2) if dry else (STEPS, WARMUP, ROUNDS)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (4 if dry else 8, cfg.block_size), generator=g)
    x, y = x.to(device), torch.roll(x, -1, 1).to(device)
    amp = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else nullcontext
    tasks: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    models: dict[str, Any] = {}
    params = 0
    for name in (TORCH, ON, OFF):
        try:
            model, opt = _variant(name, cfg, device, spec["compiled"])
            models[name] = model

            def task(model: Any = model, opt: Any = opt, name: str = name) -> None:
                if name in errors:  # it raised in an earlier round: its times are dropped
                    return
                try:
                    for _ in range(steps):
                        opt.zero_grad()
                        with amp():
                            loss = lm_loss(model(x).float(), y)
                        loss.backward()
                        opt.step()
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

            task()  # builds the buckets, compiles: a variant that raises is left out
            if name not in errors:
                tasks[name] = task
            params = sum(p.numel() for p in opt.param_groups[0]["params"])
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            gc.collect()
    times = time_interleaved(tasks, warmup=warmup, rounds=rounds, device="cuda" if cuda else "cpu")
    per_step = {name: [t / steps for t in ts] for name, ts in times.items() if name not in errors}
    out = {"times": per_step, "errors": errors, "params": params, "tokens per step": x.numel()}
    if not spec["compiled"] and ON in tasks and ON not in errors:
        try:
            out["timeline"] = _phases(models[ON], lambda: tasks[ON](), cuda, steps)
        except Exception as exc:
            out["timeline"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return out


def _phases(model: Any, task: Callable[[], None], cuda: bool, per_task: int) -> dict[str, Any]:
    """The timeline's record of steps run alone (its intervals in the interleaved rounds span
    the other variants' steps too), next to the host's time for each."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    measured = []
    for _ in range(12 // per_task + 1):
        sync()
        t0 = time.perf_counter()
        task()
        sync()
        measured.append((time.perf_counter() - t0) / per_task)
    records = [recs[0] for _, recs in list(model.timeline.history)[-10:] if recs[0] is not None]
    if not records:
        return {"error": "the timeline kept no record"}
    got: dict[str, Any] = {"measured step (ms)": statistics.median(measured[1:]) * 1e3}
    got["timeline interval (ms)"] = statistics.median(r.interval for r in records)
    for i, phase in enumerate(PHASES):
        got[f"{phase} (ms)"] = statistics.median(r.phases[i] for r in records)
    got["records"] = len(records)
    return got


def run(ctx: Context, checks: dict[str, Check]) -> None:
    backend = "nccl" if ctx.cuda else "gloo"
    for how in ("eager", "compiled"):
        mine = [checks[f"speed.{how}.{k}"] for k in PAIRS]
        mine += [checks["speed.timeline_phases"]] if how == "eager" else []
        if how == "compiled" and ctx.left_s() < LIMIT_S["compiled"] * 0.6:
            for c in mine:
                c.finish(SKIPPED, f"skipped: {ctx.left_s():.0f} s of the budget left, "
                                    "compiling needs about 150 s")  # fmt: skip
            continue
        compiled = None if how == "eager" else ("eager" if ctx.dry else "inductor")
        spec = {"cuda": ctx.cuda, "dry": ctx.dry, "compiled": compiled}
        try:
            out = run_job(ctx, step_times, 1, (spec,), backend=backend, limit_s=LIMIT_S[how],
                          pg_timeout_s=600.0)[0]  # fmt: skip
        except Exception as exc:
            # Past its limit (compiling, most likely) the job is cut for the budget: a skip.
            timed_out = "no result within" in str(exc)
            for c in mine:
                c.finish(SKIPPED if timed_out else ERROR, f"the job failed: {job_error(exc)}")
            continue
        for key, c in zip(PAIRS, mine[:2], strict=True):
            judge(c, key, out, compiled)
        if how == "eager":
            judge_phases(checks["speed.timeline_phases"], out.get("timeline"), ctx.cuda)


def judge(check: Check, key: str, out: dict[str, Any], compiled: str | None) -> None:
    a, b, target = PAIRS[key]
    times = out["times"]
    note = ""
    if key == "vs_torch" and a not in times and OFF in times:  # the timeline raised
        raised = out["errors"].get(ON)
        a, note = OFF, f" (with the timeline off: the timeline-on variant raised {raised})"
    missing = [v for v in (a, b) if v not in times]
    if missing:
        errors = {v: out["errors"].get(v, "not timed") for v in missing}
        check.finish(ERROR, f"could not time {', '.join(missing)}", errors=errors)
        return
    med = {v: statistics.median(t) for v, t in times.items()}
    per_round = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
    q = statistics.quantiles(per_round, n=4) if len(per_round) >= 2 else per_round * 3
    ratio = med[a] / med[b]
    check.finish(
        MET if ratio <= target else MISSED,
        f"{a} / {b}: {ratio:.4f} ({ratio - 1:+.2%}){note}",
        **{f"median step, {v} (ms)": m * 1e3 for v, m in med.items()},
        ratio_of_medians=ratio,
        median_of_round_ratios=statistics.median(per_round),
        round_ratios_quartiles=[q[0], q[-1]],
        rounds=len(per_round),
        parameters=out["params"],
        tokens_per_step=out["tokens per step"],
        compiled=compiled or "no",
    )  # fmt: skip


def judge_phases(check: Check, got: dict[str, Any] | None, cuda: bool) -> None:
    if got is None:
        check.finish(ERROR, "the timeline-on variant could not run")
        return
    if "error" in got:
        check.finish(FAIL, f"reading the timeline raised {got['error']}")
        return
    ratio = got["timeline interval (ms)"] / got["measured step (ms)"]
    got["interval / measured"] = ratio
    problems = []
    if not 0.85 <= ratio <= 1.15:
        problems.append(f"the timeline's interval is {ratio:.3f} of the measured step")
    if not 0 < got["forward (ms)"] < got["backward (ms)"]:
        problems.append("forward and backward phases are not 0 < forward < backward")
    if not cuda:  # the host's clock on CPU: the bounds are the GPU's
        check.finish(PASS, "dry mode: the host clock's figures; the bounds apply on the GPU", **got)
        return
    check.finish(FAIL if problems else PASS, "; ".join(problems), **got)
