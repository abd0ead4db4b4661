"""How often the straggler report names a rank when none is slow, and finds one that is.

    python benchmarks/straggler_false_positives.py --model mlp               # tiny MLP, fast steps
    python benchmarks/straggler_false_positives.py --model gpt --runs 4 --steps 100
    python benchmarks/straggler_false_positives.py --model mlp --load 2      # + 2 busy processes
    python benchmarks/straggler_false_positives.py --model gpt --detect-ms   # no detection runs
    python benchmarks/straggler_false_positives.py --replay H.pt --detect-ms  # judge saved runs

Balanced runs first: ``--runs`` trainings of ``--steps`` steps on ``--world`` gloo CPU ranks (one
thread each), every rank doing the same work, no delay injected, with gradsync's step timeline on
(``straggler_every=10``) and its history kept whole (``model.timeline.history`` replaced by a
``deque(maxlen=100000)`` right after construction). Offline, the history after the first
``--skip`` steps (start-up: allocator, first-touch) is cut into consecutive windows of 10 steps
and each window is judged by ``gradsync.timing.attribution.attribute`` over a grid of
thresholds (``min_late_ms`` x ``min_late_fraction``, ``min_share`` at its default, 0.8). Printed:
the fraction of windows that name somebody, for each pair (a false positive: nobody was slow).
Also the live reports rank 0 logged during the runs (the same windows, aligned on the wrapper's
own counter), and how late the latest rank of a window was on average (the margin the threshold
has to beat).

Then the counterpart, detection: ``--detect-runs`` runs per delay in ``--detect-ms`` in which
rank ``--slow-rank`` sleeps that many milliseconds in its data loading (before taking the batch)
every step; printed is the fraction of windows, at the default thresholds (5 ms, 5 %), that name
that rank in phase "data", and how many name anybody else.

``--load N`` starts N busy-loop processes for the whole run (killed at its end), as on a loaded
CI machine. Models: ``gpt`` is the main job's (``examples/train_gpt.py``: 4 layers, 128 wide, block
64, vocabulary 27, float64, AdamW, 32 sequences a step split over the ranks); ``mlp`` is a tiny
3-layer MLP (64-256-256-10, float32, batch 32 per rank, AdamW) whose steps take a few
milliseconds, so that the machine's noise is as large as it gets next to a step.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.spawn import spawn
from gradsync.timing import Thresholds
from gradsync.timing.attribution import attribute
from gradsync.timing.slots import LIMIT_MS

WINDOW = 10
KEEP = 100  # steps a timeline keeps (StepTimeline's keep)
GRID_MS = (0.0, 1.0, 2.0, 5.0, 10.0)
GRID_FRACTION = (0.0, 0.02, 0.05, 0.10)


class _Count(logging.Handler):
    """Counts the straggler logger's records (and keeps them off stderr)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_level: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.by_level[record.levelname] = self.by_level.get(record.levelname, 0) + 1


def _build(model: str, rank: int, world: int) -> tuple[nn.Module, Any, list[tuple[Any, Any]]]:
    """(module, loss function, a few batches of this rank)."""
    g = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    if model == "gpt":
        module: nn.Module = GPT(GPTConfig(vocab_size=27, block_size=64)).to(torch.float64)
        per_rank = max(1, 32 // world)
        batches = []
        for _ in range(8):
            x = torch.randint(0, 27, (per_rank, 64), generator=g)
            batches.append((x, torch.randint(0, 27, (per_rank, 64), generator=g)))
        return module, lm_loss, batches
    module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                           nn.Linear(256, 10))  # fmt: skip
    batches = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(8)]  # fmt: skip
    return module, nn.functional.cross_entropy, batches


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Rank body: train ``cfg["steps"]`` steps; rank 0 returns the whole timeline history."""
    log = logging.getLogger("gradsync.stragglers")
    log.setLevel(logging.INFO)
    log.propagate = False
    counter = _Count()
    log.addHandler(counter)
    module, loss_fn, batches = _build(cfg["model"], rank, world)
    model = gradsync.DistributedDataParallel(module, straggler_every=WINDOW)
    model.timeline.history = collections.deque(maxlen=100_000)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    delay = cfg["delay_ms"] / 1e3 if rank == cfg["slow_rank"] else 0.0
    every, pad = cfg.get("every", 1), cfg.get("pad_ms", 0.0) / 1e3
    if delay and cfg.get("where") == "forward":  # in its forward instead (every ``every`` steps)
        module.register_forward_pre_hook(
            lambda *a: time.sleep(delay) if step % every == 0 else None
        )
    ends = []
    for step in range(cfg["steps"]):
        if pad:
            time.sleep(pad)  # every rank: a longer step without more CPU work
        if delay and cfg.get("where", "data") == "data" and step % every == 0:
            time.sleep(delay)  # slow data loading on this rank, before the batch
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        ends.append(time.perf_counter())
    if rank != 0:
        return None
    walls = [(b - a) * 1e3 for a, b in zip(ends, ends[1:], strict=False)]
    return {
        "history": list(model.timeline.history),
        "wall_ms": statistics.median(walls[cfg["skip"] :] or walls),
        "logged": dict(counter.by_level),
    }


def windows(history: list[tuple[int, list[Any]]], skip: int, every: int = WINDOW) -> list[Any]:
    """Windows of ``WINDOW`` steps after the first ``skip``, one starting every ``every``
    steps, each with the history the live timeline would hold at its end (its last ``KEEP``
    steps, start-up included): the reference its stalls are judged against."""
    first = next((i for i, (s, _) in enumerate(history) if s >= skip), len(history))
    ends = range(first + WINDOW, len(history) + 1, every)
    return [(history[end - WINDOW : end], history[max(0, end - KEEP) : end]) for end in ends]


def _burn() -> None:
    while True:
        pass


def _runs(model: str, world: int, n: int, steps: int, skip: int, delay_ms: float,
          slow_rank: int) -> list[dict[str, Any]]:  # fmt: skip
    cfg = dict(model=model, steps=steps, skip=skip, delay_ms=delay_ms, slow_rank=slow_rank)
    return [spawn(run_rank, world, (cfg,), pg_timeout_s=120, timeout_s=1800)[0] for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["gpt", "mlp"], default="mlp")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--runs", type=int, default=5, help="balanced runs (0: none)")
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--skip", type=int, default=10, help="start-up steps left out of the windows")
    p.add_argument("--load", type=int, default=0, help="busy-loop processes during the runs")
    p.add_argument("--detect-ms", type=float, nargs="*", default=[10.0, 50.0])
    p.add_argument("--detect-runs", type=int, default=2, help="runs per injected delay")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--save", default="", help="torch.save the balanced runs' histories here")
    p.add_argument("--replay", default="", help="judge the histories --save wrote (no runs)")
    args = p.parse_args()
    burners = [mp.get_context("spawn").Process(target=_burn, daemon=True)
               for _ in range(args.load)]  # fmt: skip
    for b in burners:
        b.start()
    try:
        _main(args)
    finally:
        for b in burners:  # only the processes this script started
            b.terminate()
            b.join()


def _balanced(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    if args.replay:  # histories saved by --save: judge them again, no training
        runs = [{"history": h, "wall_ms": float("nan"), "logged": {}}
                for h in torch.load(args.replay, weights_only=False)]  # fmt: skip
        print(f"replaying {len(runs)} saved run(s) from {args.replay}")
    else:
        runs = _runs(args.model, args.world, args.runs, args.steps, args.skip, 0.0, args.slow_rank)
    pairs = [p for run in runs for p in windows(run["history"], args.skip)]
    wins = [w for w, _ in pairs]
    # a value over slots.LIMIT_MS cannot have been written (write clamps): the slots were not
    # what the ranks wrote
    bad = [
        (i, s)
        for i, run in enumerate(runs)
        for s, recs in run["history"]
        if any(r is not None and not max(*r.phases, *r.launches) <= LIMIT_MS for r in recs)
    ]
    if bad:
        print(
            f"!! {len(bad)} step records hold a value over {LIMIT_MS:g} ms (or inf/nan), which "
            f"no rank can write: runs {sorted({i for i, _ in bad})}, first at step {bad[0][1]}"
        )
    reports = [attribute(w, Thresholds(), ref) for w, ref in pairs]  # at the defaults, once
    steps_ms = [rep["step_ms"] for rep in reports]
    walls = ", ".join(f"{r['wall_ms']:.2f}" for r in runs)
    lengths = "/".join(str(len(r["history"])) for r in runs)
    print(
        f"balanced: {len(runs)} runs x {args.steps} steps ({time.perf_counter() - t0:.0f} s), "
        if not args.replay
        else f"balanced, replayed: {len(runs)} runs ({lengths} step records), ",
        end="",
    )
    print(
        f"{len(wins)} windows of {WINDOW} steps after the first {args.skip} | median step "
        f"(timeline interval) {statistics.median(steps_ms):.2f} ms, per-window medians "
        f"{min(steps_ms):.2f}-{max(steps_ms):.2f} ms"
        + ("" if args.replay else f" | wall-clock step on rank 0, median per run: {walls} ms")
    )
    print()
    print("Fraction of balanced windows that name a straggler (min_share at its default):")
    print()
    print("| min_late_ms \\ min_late_fraction | " + " | ".join(f"{f:g}" for f in GRID_FRACTION)
          + " |")  # fmt: skip
    print("|---:|" + "---:|" * len(GRID_FRACTION))
    for a in GRID_MS:
        cells = []
        for f in GRID_FRACTION:
            named = sum(bool(attribute(w, Thresholds(a, f))["stragglers"]) for w in wins)
            cells.append(f"{named / len(wins):.3f} ({named})")
        print(f"| {a:g} | " + " | ".join(cells) + " |")
    # the margin: per window, the largest mean lateness of any rank and how often it was last
    worst = []
    last_in = []
    for w in wins:
        ranks = attribute(w, Thresholds(0.0, 0.0))["ranks"]
        worst.append(max(e["late_ms"] for e in ranks.values()))
        slowest = collections.Counter(  # the rank with the most busy time, step by step
            max((r for r, rec in enumerate(recs) if rec is not None), key=lambda r: recs[r].busy)
            for _, recs in w
        )
        last_in.append(max(slowest.values()))
    print()
    print(
        f"per window, the latest rank's mean lateness (ms): median {statistics.median(worst):.2f}, "
        f"90th pct {_pct(worst, 0.9):.2f}, max {max(worst):.2f}; the most steps one rank was "
        f"last in (any lateness, of {WINDOW}): median {statistics.median(last_in):g}, max "
        f"{max(last_in)}"
    )
    for i, rep in enumerate(reports):  # what the defaults named, window by window
        for s in rep["stragglers"]:
            print(
                f"  named at the defaults: window {i} (steps {rep['steps'][0]}-{rep['steps'][1]}"
                f"), rank {s['rank']}, {s['phase']}, late in {s['late_in']} of {s['of']}, "
                f"+{s['late_ms']:.2f} ms (threshold {rep['threshold_ms']:.2f}, step "
                f"{rep['step_ms']:.2f} ms)"
            )
    # every alignment: a window ending at every step (overlapping), as a report at a random step
    sliding_pairs = [p for run in runs for p in windows(run["history"], args.skip, every=1)]
    sliding = [w for w, _ in sliding_pairs]
    sliding_reports = [attribute(w, Thresholds(), ref) for w, ref in sliding_pairs]
    named = sum(bool(rep["stragglers"]) for rep in sliding_reports)
    named10 = sum(bool(attribute(w, Thresholds(5.0, 0.10))["stragglers"]) for w in sliding)
    print(
        f"windows ending at every step (overlapping, {len(sliding)}): named at the defaults "
        f"{named / len(sliding):.3f} ({named}); at (5 ms, 10 %) {named10 / len(sliding):.3f} "
        f"({named10})"
    )
    # stalls: a few steps in which a rank was very late (see [Note: naming a straggler])
    shares = [max((e["lost_pct"] for e in rep["ranks"].values()), default=0.0) for rep in reports]
    stalls = sum(bool(rep["stalls"]) for rep in reports)
    stalls_sliding = sum(bool(rep["stalls"]) for rep in sliding_reports)
    print(
        f"stalls named at the defaults: {stalls} of {len(wins)} windows, {stalls_sliding} of "
        f"{len(sliding)} overlapping ones; per window, the largest share any rank cost "
        f"(every step it was late in): median {statistics.median(shares):.1f} %, max "
        f"{max(shares):.1f} %, >= 15 % in {sum(x >= 15.0 for x in shares)}"
    )
    if args.save:
        torch.save([r["history"] for r in runs], args.save)
        print(f"histories saved to {args.save}")
    logged: collections.Counter[str] = collections.Counter()
    for run in runs:
        logged.update(run["logged"])
    print(
        f"live reports on rank 0 (defaults): {logged.get('WARNING', 0)} straggler lines, "
        f"{logged.get('INFO', 0)} 'no straggler'"
    )


def _main(args: argparse.Namespace) -> None:
    print(
        f"{datetime.date.today()} | {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at start, torch {torch.__version__}, gloo, {args.world} ranks "
        f"x 1 thread | model {args.model} | {args.load} busy-loop process(es) added"
    )
    t0 = time.perf_counter()
    if args.runs or args.replay:
        _balanced(args)
    if not args.detect_ms:
        return
    print()
    print(
        f"Detection: rank {args.slow_rank} sleeps before its batch every step; default "
        f"thresholds (5 ms, 5 %); {args.detect_runs} run(s) x {args.steps} steps per delay"
    )
    print()
    print("| injected | windows | median step (ms) | threshold (ms) | named, phase data | "
          "named, other phase | others named | reported late (ms, median) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for delay in args.detect_ms:
        runs = _runs(args.model, args.world, args.detect_runs, args.steps, args.skip, delay,
                     args.slow_rank)  # fmt: skip
        pairs = [p for run in runs for p in windows(run["history"], args.skip)]
        reports = [attribute(w, Thresholds(), ref) for w, ref in pairs]
        data = other_phase = others = 0
        late = []
        for rep in reports:
            mine = [s for s in rep["stragglers"] if s["rank"] == args.slow_rank]
            if mine and mine[0]["phase"] == "data":
                data += 1
            elif mine:
                other_phase += 1
            if mine:
                late.append(mine[0]["late_ms"])
            others += any(s["rank"] != args.slow_rank for s in rep["stragglers"])
        n = len(reports)
        print(
            f"| {delay:g} ms | {n} | {statistics.median(r['step_ms'] for r in reports):.2f} | "
            f"{statistics.median(r['threshold_ms'] for r in reports):.2f} | "
            f"{data / n:.3f} ({data}) | {other_phase / n:.3f} ({other_phase}) | "
            f"{others / n:.3f} ({others}) | "
            f"{statistics.median(late) if late else float('nan'):.2f} |"
        )
    end_load = os.getloadavg()[0]
    print(f"\n(total {time.perf_counter() - t0:.0f} s, load average {end_load:.1f} at end)")


if __name__ == "__main__":
    main()
