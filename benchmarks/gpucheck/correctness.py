"""Correctness: N processes train what one process trains, on every communication path.

Four jobs, each training every mode of ``modes.py`` for 4 steps of SGD with momentum on the
small GPT whose backward starts with a slow kernel (``common.SlowGrad``):

- ``n1``: world size 1 on NCCL; in the same process, one process without a wrapper (the
  reference) and torch DDP with the same feature;
- ``serial``: ``n1`` again with ``CUDA_LAUNCH_BLOCKING=1``: every kernel finishes before the
  next is queued, so no stream can overtake another. A stream-order bug (a hook, a collective or
  a copy on a stream that does not wait for the backward's) gives ``n1`` other bits than this;
- ``g2``: 2 gloo ranks sharing the one GPU, each on half of the global batch;
- ``nccl2``: 2 NCCL ranks, where the machine has 2 GPUs.

Dry mode runs ``n1`` and ``g2`` on CPU gloo ranks.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

import gradsync

from .common import (
    ERROR,
    FAIL,
    PASS,
    Check,
    Context,
    device_of,
    exact_math,
    job_error,
    relative_error,
    run_job,
)
from .modes import BY_SLUG, MODES, STEPS, Mode, Run, initial_params, reference_of

LIMIT_S = 180.0  # the 3 one-GPU jobs (60 s each at most); mostly process, CUDA and NCCL start
NEEDS_S = 40.0


def declare() -> list[Check]:
    checks = [
        Check(
            f"correctness.{m.slug}", f"correctness: {m.name}",
            "parameters after 4 steps, relative to how far training moved them: world size 1 "
            "(NCCL) vs one process; vs the same run serialised (CUDA_LAUNCH_BLOCKING=1); 2 gloo "
            "ranks on the GPU vs one process; torch DDP's figures beside",
            ("world 1: " + ("bit for bit" if m.bound_ref == 0 else
                            "none (no exact reference)" if m.bound_ref is None
                            else f"<= {m.bound_ref:g}")
             + "; serialised: bit for bit; 2 ranks: "
             + f"<= {m.bound_g2:g}" + (" of world size 1's" if m.bound_ref is None else "")
             + f" ({m.why})"),
        )
        for m in MODES
    ]  # fmt: skip
    checks.append(Check(
        "correctness.replica_device", "the wrapper's collectives on the replica's GPU",
        "world size 1 with the replica on GPU 1: wrapping while GPU 0 is current, then 4 steps "
        "with check_finite and item_mean (the readout, the item count) after set_device(1)",
        "the first refused with UsageError; the steps allocate nothing on GPU 0",
    ))  # fmt: skip
    checks.append(Check(
        "correctness.nccl2", "correctness: every mode on 2 NCCL ranks",
        "each mode's parameters on 2 NCCL ranks vs one process (vs world size 1 for PowerSGD)",
        "each mode's 2-rank bound, as above",
    ))  # fmt: skip
    return checks


def train_modes(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body: every mode in ``spec["modes"]`` by gradsync (and torch DDP with
    ``spec["torch"]``; the one-process references with ``spec["reference"]``)."""
    cuda = spec["cuda"]
    exact_math(cuda)
    device = device_of(cuda)
    out: dict[str, Any] = {"gradsync": {}, "torch": {}, "ref": {}, "init": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if spec["reference"] and rank == 0:
            for loop, slug in (("plain", "default"), ("item_mean", "item_mean"),
                               ("master", "main_grads")):  # fmt: skip
                run = Run(BY_SLUG[slug], "reference", rank, world, device)
                out["ref"][loop] = run.train()
                out["init"][loop] = initial_params(device, loop)
        for slug in spec["modes"]:
            mode = BY_SLUG[slug]
            out["gradsync"][slug] = _attempt(mode, "gradsync", rank, world, device)
            if spec["torch"] and mode.torch_twin is not None:
                out["torch"][slug] = _attempt(mode, "torch", rank, world, device)
    # Nondeterministic kernels (warn_only) would explain bits that differ between runs.
    out["warnings"] = sorted({str(w.message)[:200] for w in caught
                              if "determinis" in str(w.message)})  # fmt: skip
    return out


def _attempt(mode: Mode, impl: str, rank: int, world: int, device: Any) -> dict[str, Any]:
    """``{"params", "nan_probe"}`` of one run, or ``{"error"}``: one mode failing must not
    stop the others."""
    try:
        run = Run(mode, impl, rank, world, device, timeout_s=20.0)
        params = run.train(STEPS)
        probe = run.nan_probe() if mode.slug == "check_finite" and impl == "gradsync" else None
        run.close()
        return {"params": params, "nan_probe": probe}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        gc.collect()


def run(ctx: Context, checks: dict[str, Check]) -> None:
    slugs = [m.slug for m in MODES]
    backend = "nccl" if ctx.cuda else "gloo"
    spec = {"cuda": ctx.cuda, "modes": slugs, "torch": True, "reference": True}
    jobs: dict[str, Any] = {}
    for name, world, bk, env, job_spec in (
        ("n1", 1, backend, None, spec),
        ("serial", 1, backend, {"CUDA_LAUNCH_BLOCKING": "1"}, {**spec, "torch": False,
                                                             "reference": False}),
        ("g2", 2, "gloo", None, {**spec, "reference": False}),
    ):  # fmt: skip
        if name == "serial" and not ctx.cuda:
            continue
        try:
            jobs[name] = run_job(ctx, train_modes, world, (job_spec,), backend=bk,
                                 limit_s=LIMIT_S / 3, env=env)  # fmt: skip
        except Exception as exc:
            jobs[name] = exc
    n1 = jobs["n1"]
    for mode in MODES:
        check = checks[f"correctness.{mode.slug}"]
        if isinstance(n1, BaseException):
            check.finish(ERROR, f"the world-size-1 job failed: {job_error(n1)}")
            continue
        judge(check, mode, n1[0], jobs.get("serial"), jobs["g2"], ctx)
    if ctx.needs(checks, ["correctness.replica_device", "correctness.nccl2"], gpus=2):
        _replica_device(ctx, checks["correctness.replica_device"])
        _nccl2(ctx, checks["correctness.nccl2"], n1)


def replica_device(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank body (world size 1, a machine with 2 GPUs)."""
    gpu1 = torch.device("cuda", 1)
    mode = Mode("check_finite + item_mean", "x", {"check_finite": True}, loop="item_mean")
    out: dict[str, Any] = {}
    torch.cuda.set_device(0)
    try:
        Run(mode, "gradsync", rank, world, gpu1)
        out["wrapped on GPU 1 while GPU 0 is current"] = "accepted"
    except gradsync.UsageError as exc:
        out["wrapped on GPU 1 while GPU 0 is current"] = f"UsageError: {str(exc)[:200]}"
    gc.collect()
    torch.cuda.set_device(1)
    before = torch.cuda.memory_allocated(0)
    Run(mode, "gradsync", rank, world, gpu1).train(STEPS)
    out["bytes allocated on GPU 0 by the steps"] = torch.cuda.memory_allocated(0) - before
    return out


def _replica_device(ctx: Context, check: Check) -> None:
    try:
        out = run_job(ctx, replica_device, 1, ({},), backend="nccl", limit_s=LIMIT_S / 3)[0]
    except Exception as exc:
        check.finish(ERROR, f"the job failed: {job_error(exc)}")
        return
    ok = out["wrapped on GPU 1 while GPU 0 is current"].startswith("UsageError") and (
        out["bytes allocated on GPU 0 by the steps"] == 0
    )
    check.finish(PASS if ok else FAIL, "", **out)


def judge(check: Check, mode: Mode, n1: dict[str, Any], serial: Any, g2: Any, ctx: Context) -> None:
    """Fill ``check`` for ``mode`` from the jobs' results."""
    loop = reference_of(mode)
    ref, init = n1["ref"][loop], n1["init"]["master" if loop == "master" else "plain"]
    m: dict[str, Any] = {"nondeterminism warnings": n1["warnings"]}
    problems: list[str] = []
    mine = n1["gradsync"][mode.slug]
    if "error" in mine:
        check.finish(FAIL, f"world size 1 raised {mine['error']}", **m)
        return
    got = mine["params"]
    err = relative_error(got, ref, init)
    m["world 1 vs one process"] = err
    if mode.bound_ref is not None and err > mode.bound_ref:
        problems.append(f"world size 1 is {err:.3g} off one process (bound {mode.bound_ref:g})")
    if serial is None:
        m["world 1 vs serialised"] = "needs CUDA"
    elif isinstance(serial, BaseException):
        problems.append(f"the serialised job failed: {job_error(serial)}")
    else:
        other = serial[0]["gradsync"][mode.slug]
        if "params" not in other:
            m["world 1 vs serialised"] = other["error"]
            problems.append(f"the serialised run raised {other['error']}")
        else:
            m["world 1 vs serialised"] = s_err = relative_error(got, other["params"], init)
            if s_err != 0.0:
                problems.append(f"world size 1 is {s_err:.3g} off its serialised run: a "
                                "stream does not wait for the backward's")  # fmt: skip
    base = got if mode.bound_ref is None else ref  # PowerSGD: 2 ranks equal world size 1
    problems += _two_ranks(m, mode, g2, base, init, ctx)
    _torch_figures(m, mode, n1, g2, ref, init)
    if mine.get("nan_probe") is not None:
        m["NaN step on rank 0, world 1"] = mine["nan_probe"]
        if mine["nan_probe"] != "NonFiniteGradientError":
            problems.append(f"a NaN gradient raised {mine['nan_probe']}")
    check.finish(FAIL if problems else PASS, "; ".join(problems), **m)


def _two_ranks(
    m: dict[str, Any], mode: Mode, g2: Any, base: dict, init: dict, ctx: Context
) -> list[str]:
    if isinstance(g2, BaseException):
        return [f"the 2-rank job failed: {job_error(g2)}"]
    ranks = [r["gradsync"][mode.slug] for r in g2]
    if any("error" in r for r in ranks):
        error = next(r["error"] for r in ranks if "error" in r)
        if ctx.cuda and mode.gloo_refuses_cuda and error.startswith("UsageError"):
            m["2 gloo ranks"] = f"refused, as documented: {error[:160]}"
            return []
        return [f"2 ranks raised {error}"]
    err = relative_error(ranks[0]["params"], base, init)
    m["2 ranks vs " + ("world 1" if mode.bound_ref is None else "one process")] = err
    same = all(ranks[0]["params"][n].equal(ranks[1]["params"][n]) for n in base)
    m["2 ranks: replicas equal"] = same
    problems = [] if same else ["the 2 ranks' replicas differ"]
    if mode.slug == "check_finite":
        m["NaN step on rank 0, 2 ranks"] = [r["nan_probe"] for r in ranks]
        if any(r["nan_probe"] != "NonFiniteGradientError" for r in ranks):
            problems.append("a NaN gradient on rank 0 was not raised on every rank")
    if err > mode.bound_g2:
        problems.append(f"2 ranks are {err:.3g} off (bound {mode.bound_g2:g})")
    return problems


def _torch_figures(m: dict[str, Any], mode: Mode, n1: dict, g2: Any, ref: dict, init: dict) -> None:
    """torch DDP's errors in the same metric (reported; torch's hooks round differently)."""
    if mode.torch_twin is None:
        m["torch DDP"] = "has no such feature"
        return
    t1 = n1["torch"].get(mode.slug, {})
    base = t1.get("params") if mode.bound_ref is None else ref
    m["torch DDP world 1"] = relative_error(t1["params"], ref, init) if "params" in t1 else (
        t1.get("error"))  # fmt: skip
    if isinstance(g2, BaseException) or base is None:
        return
    t2 = g2[0]["torch"].get(mode.slug, {})
    m["torch DDP 2 gloo ranks"] = (
        relative_error(t2["params"], base, init) if "params" in t2 else t2.get("error")
    )


def _nccl2(ctx: Context, check: Check, n1: Any) -> None:
    """Every mode on 2 NCCL ranks against one process (a machine with 2 GPUs)."""
    spec = {"cuda": True, "modes": [m.slug for m in MODES], "torch": True, "reference": False}
    try:
        out = run_job(ctx, train_modes, 2, (spec,), backend="nccl", limit_s=LIMIT_S / 3)
    except Exception as exc:
        check.finish(ERROR, f"the 2-rank NCCL job failed: {job_error(exc)}")
        return
    if isinstance(n1, BaseException):
        check.finish(ERROR, "no reference: the world-size-1 job failed")
        return
    problems, measured = [], {}
    for mode in MODES:
        loop = reference_of(mode)
        init = n1[0]["init"]["master" if loop == "master" else "plain"]
        got = out[0]["gradsync"][mode.slug]
        base = n1[0]["gradsync"][mode.slug].get("params") if mode.bound_ref is None else (
            n1[0]["ref"][loop])  # fmt: skip
        if "error" in got or base is None:
            measured[mode.slug] = got.get("error", "no world-size-1 result")
            problems.append(mode.slug)
            continue
        measured[mode.slug] = err = relative_error(got["params"], base, init)
        if err > mode.bound_g2:
            problems.append(f"{mode.slug} ({err:.3g})")
    check.finish(FAIL if problems else PASS, "; ".join(problems), **measured)
