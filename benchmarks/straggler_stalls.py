"""Stalls: a rank late in every Nth step is named, balanced runs name nobody; new rule and old.

    python benchmarks/straggler_stalls.py                          # 40 ms every 5th step, MLP
    python benchmarks/straggler_stalls.py --load 2                 # + 2 busy processes
    python benchmarks/straggler_stalls.py --stall-ms 1 --pad-ms 0  # a 1 ms stall, short steps
    python benchmarks/straggler_stalls.py --replay H.pt            # judge saved runs again

Two kinds of runs of ``--steps`` steps on ``--world`` gloo CPU ranks (one thread each), each
rank's history kept whole (``straggler_false_positives.run_rank``): ``--runs`` balanced runs
(every rank the same work) and ``--stall-runs`` runs in which rank 1 sleeps ``--stall-ms`` in
its forward (``--where``) in every ``--every``th step. Every rank sleeps ``--pad-ms`` before
each batch, which lengthens the step without adding CPU work (so that a 40 ms stall in every
5th step costs the job about a fifth of its time, as in issue 52). The history after the first
``--skip`` steps is cut into windows of 10 steps, each judged as the live timeline would judge
it (its noise measured over the 100 steps before its end) by the default rule, and by the rule
it replaced: a step counted towards a stall only if the rank was 40 ms late in it, and those
steps had to cost 20 % of the window. Printed per kind: windows, median step, and how many
named a stall (balanced: every one is a false positive; stalls: rank 1, and any other rank).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
from typing import Any

import torch
from straggler_false_positives import _burn, run_rank, windows

from gradsync.testing.spawn import spawn
from gradsync.timing import Thresholds
from gradsync.timing.attribution import _late_in, _window_ms, attribute


def old_rule(window: list[Any]) -> set[int]:
    """The ranks the 40 ms rule named as a stall (before issue 52)."""
    steps = [(s, recs) for s, recs in window if len(_late_in(recs)) >= 2]
    intervals = [rec.interval for _, recs in steps for rec in recs if rec is not None]
    floor = max(5.0, 0.05 * statistics.median(intervals)) if intervals else 0.0
    lost: dict[int, float] = {}
    for _, recs in steps:
        for r, late in _late_in(recs).items():
            if late >= max(floor, 40.0):
                lost[r] = lost.get(r, 0.0) + late
    window_ms = _window_ms(steps)
    return {r for r, v in lost.items() if window_ms and v >= 0.2 * window_ms}


def _judge(kind: str, histories: list[Any], skip: int) -> None:
    pairs = [p for h in histories for p in windows(h, skip)]
    reports = [attribute(w, Thresholds(), ref) for w, ref in pairs]
    new = [{s["rank"] for s in rep["stalls"]} for rep in reports]
    old = [old_rule(w) for w, _ in pairs]
    step = statistics.median(rep["step_ms"] for rep in reports)
    cost = [e["lost_pct"] for rep in reports for r, e in rep["ranks"].items() if r == 1]
    print(
        f"| {kind} | {len(pairs)} | {step:.2f} | {statistics.median(cost):.1f} | "
        f"{sum(1 in n for n in new)} | {sum(bool(n - {1}) for n in new)} | "
        f"{sum(1 in o for o in old)} | {sum(bool(o - {1}) for o in old)} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["gpt", "mlp"], default="mlp")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="balanced runs")
    p.add_argument("--stall-runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=10, help="start-up steps left out of the windows")
    p.add_argument("--stall-ms", type=float, default=40.0)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--pad-ms", type=float, default=25.0)
    p.add_argument("--where", choices=["data", "forward"], default="forward")
    p.add_argument("--load", type=int, default=0, help="busy-loop processes during the runs")
    p.add_argument("--save", default="", help="torch.save both kinds of histories here")
    p.add_argument("--replay", default="", help="judge the histories --save wrote (no runs)")
    args = p.parse_args()
    print(
        f"{datetime.date.today()} | {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at start, torch {torch.__version__}, {args.world} ranks | "
        f"model {args.model}, every rank sleeps {args.pad_ms:g} ms a step | {args.load} busy "
        f"loop(s) | stall: rank 1, {args.stall_ms:g} ms in its {args.where}, every "
        f"{args.every}th step"
    )
    if args.replay:
        runs = torch.load(args.replay, weights_only=False)
    else:
        burners = [mp.get_context("spawn").Process(target=_burn, daemon=True)
                   for _ in range(args.load)]  # fmt: skip
        for b in burners:
            b.start()
        try:
            runs = {kind: _histories(args, delay) for kind, delay in
                    (("balanced", 0.0), ("stall", args.stall_ms))}  # fmt: skip
        finally:
            for b in burners:  # only the processes this script started
                b.terminate()
                b.join()
    if args.save:
        torch.save(runs, args.save)
    print()
    print("| runs | windows | median step (ms) | rank 1's cost (median %) | rank 1 named | "
          "others named | old rule: rank 1 | old rule: others |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, histories in runs.items():
        _judge(kind, histories, args.skip)
    print(f"\n(load average {os.getloadavg()[0]:.1f} at end)")


def _histories(args: argparse.Namespace, delay: float) -> list[Any]:
    cfg = dict(model=args.model, steps=args.steps, skip=args.skip, delay_ms=delay, slow_rank=1,
               every=args.every, pad_ms=args.pad_ms, where=args.where)  # fmt: skip
    n = args.stall_runs if delay else args.runs
    return [spawn(run_rank, args.world, (cfg,), pg_timeout_s=120, timeout_s=1800)[0]["history"]
            for _ in range(n)]  # fmt: skip


if __name__ == "__main__":
    main()
