"""Every CUDA claim of gradsync checked on a real GPU, in one command that fits 8 minutes.

    make gpu-check                                   # on a GPU machine: the whole check
    python benchmarks/gpu_check.py                   # the same
    python benchmarks/gpu_check.py --dry --out /tmp/gc   # CPU: every code path, tiny models
    python benchmarks/gpu_check.py --groups correctness syncs   # some groups only

Writes ``benchmarks/gpu-check-<device>-<date>.md`` and ``.json`` (``--out``, ``--name``): every
check with what it compares, its bound, what it measured, and its status. Exits 1 if a check
fails or could not run through an error (a speed target that is missed is reported, not
failed), 2 without CUDA (unless ``--dry``). The groups run in order of importance, each under
its own time limit, and a group that no longer fits the budget (``--budget-s``, 450 s by default
on a GPU) is reported as skipped, so the run ends within the budget plus one job's start:

=============  ================================================================  ==============
group          what                                                              H100 estimate
=============  ================================================================  ==============
correctness    12 modes x (gradsync, torch DDP, one process), 3-4 jobs            60-90 s
syncs          each setting's steps under ``set_sync_debug_mode("error")``        20-30 s
deadline       the CUDA-event deadline against a GPU held past it                15-20 s
overlap        ``torch.profiler`` traces of a few steps, default and bf16 wire   30-45 s
speed          GPT 124M, bf16 autocast, vs torch DDP, timeline on/off, compiled  120-200 s
=============  ================================================================  ==============

Checks that need 2 GPUs (NCCL with 2 ranks) are written and reported as skipped on one GPU.
See docs/gpu.md ("Checking it on a GPU").
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

import torch
from gpucheck import correctness, deadline, overlap, report, speed, syncs
from gpucheck.common import ERROR, SKIPPED, Check, Context, environment

GROUPS = {
    "correctness": correctness, "syncs": syncs, "deadline": deadline, "overlap": overlap,
    "speed": speed,
}  # fmt: skip
"""In the order they run: a group that no longer fits the budget is skipped, not the first."""
HERE = Path(__file__).resolve().parent


def all_checks() -> list[Check]:
    """Every check of every group, in report order (the dry-mode test compares these ids)."""
    return [c for module in GROUPS.values() for c in module.declare()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU, gloo, tiny models: wiring only")
    p.add_argument("--out", type=Path, default=HERE, help="folder of the report (benchmarks/)")
    p.add_argument("--name", help="file stem (default gpu-check-<device>-<date>)")
    p.add_argument("--budget-s", type=float, help="seconds for the whole run (GPU 450, dry 300)")
    p.add_argument("--groups", nargs="+", choices=list(GROUPS), help="only these groups")
    args = p.parse_args(argv)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.dry and num_gpus == 0:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on "
              "a GPU machine, or pass --dry for the CPU wiring check", file=sys.stderr)  # fmt: skip
        return 2
    budget = args.budget_s or (300.0 if args.dry else 450.0)
    device = "dry-cpu" if args.dry else torch.cuda.get_device_name(0)
    name = args.name or f"gpu-check-{_slug(device)}-{time.strftime('%Y-%m-%d')}"
    ctx = Context(dry=args.dry, out=args.out, budget_s=budget, num_gpus=num_gpus, name=name)
    env = environment()
    checks = all_checks()
    by_id = {c.id: c for c in checks}
    seconds: dict[str, float] = {}
    for group, module in GROUPS.items():
        mine = {c.id: c for c in checks if c.id.split(".")[0] == group}
        if args.groups and group not in args.groups:
            _mark(mine, SKIPPED, "skipped: not in --groups")
            continue
        if ctx.left_s() < module.NEEDS_S:
            _mark(mine, SKIPPED, f"skipped: {ctx.left_s():.0f} s of the budget left, the group "
                                 f"needs about {module.NEEDS_S:.0f} s")  # fmt: skip
            continue
        t0 = time.monotonic()
        print(f"gpu-check: {group} ({ctx.left_s():.0f} s left)", file=sys.stderr, flush=True)
        try:
            module.run(ctx, mine)
        except Exception as exc:  # a bug of the check itself: the rest still runs
            _mark(mine, ERROR, f"the group raised {type(exc).__name__}: {exc}", only_unset=True)
        _mark(mine, ERROR, "the group reported nothing for this check", only_unset=True)
        seconds[group] = time.monotonic() - t0
        print(f"gpu-check: {group} took {seconds[group]:.0f} s: "
              + ", ".join(f"{c.id.split('.', 1)[1]} {c.status}" for c in mine.values()),
              file=sys.stderr, flush=True)  # fmt: skip
    meta = {
        "dry": args.dry, "device": device, "budget_s": budget, "group_seconds": seconds,
        "seconds": time.monotonic() - ctx.started,
        "command": " ".join(shlex.quote(a) for a in ["benchmarks/gpu_check.py", *(argv or [])]),
    }  # fmt: skip
    md, js = report.write(args.out, name, env, meta, list(by_id.values()))
    status = report.exit_status(checks)
    print(f"gpu-check: {report.summary(checks)} in {meta['seconds']:.0f} s; wrote {md} and {js}; "
          f"exit {status}", file=sys.stderr)  # fmt: skip
    return status


def _mark(checks: dict[str, Check], status: str, reason: str, only_unset: bool = False) -> None:
    for c in checks.values():
        if not only_unset or c.status == "not run":
            c.finish(status, reason)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
