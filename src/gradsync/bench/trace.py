"""``gradsync bench --trace``: a ``torch.profiler`` trace of a few steps, one file per rank.

    gradsync bench --trace                          # runs/bench/trace-rank0.json, -rank1.json
    gradsync bench --trace --out runs/trace --n-layer 2 --trace-steps 5

Trains the bench's GPT (the model flags of :func:`gradsync.bench.worker.add_model_arguments`),
wrapped in :class:`gradsync.DistributedDataParallel` at its defaults, on 2 loopback gloo ranks
(:func:`gradsync.testing.spawn.spawn`, one thread each, model on the CPU): 3 warm-up steps, then
``--trace-steps`` profiled ones (``torch.profiler.schedule``: wait 1, warmup 2, active N). Each
rank writes its Chrome/Perfetto trace (``export_chrome_trace``) to ``--out`` and the command
prints, per rank, the count and total milliseconds of each of gradsync's ranges
(:mod:`gradsync.timing.ranges`) over the profiled steps, next to the steps' own total.

What a trace shows, on the thread that runs backward:

* ``gradsync::bucket_copy_in`` (gradients into a bucket) and ``gradsync::bucket_launch`` (its
  all-reduce started) sit inside the backward, between autograd's ops: that is the part of
  gradsync's work that overlapped with backward compute.
* ``gradsync::bucket_wait`` (waiting for the buckets still on the wire),
  ``gradsync::step_checks`` (reading the step back and judging it) and
  ``gradsync::bucket_write_back`` (reduced gradients to ``.grad``) come after the last gradient:
  they overlapped with nothing, and add to the step one for one.

Open a file at https://ui.perfetto.dev (drag it in) or in Chrome at ``chrome://tracing``
(Load); one rank per file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss

RANGES = (
    "gradsync::bucket_copy_in",
    "gradsync::bucket_launch",
    "gradsync::bucket_wait",
    "gradsync::step_checks",
    "gradsync::bucket_write_back",
)
STEP = "ProfilerStep"
"""The range ``torch.profiler`` opens around each step: ``ProfilerStep#5`` in a trace, all of
them together as ``ProfilerStep*`` in ``key_averages()``."""
WAIT, WARMUP = 1, 2  # untraced steps, then steps traced and thrown away, before the active ones
WORLD = 2

Row = tuple[str, int, float]
"""(range name, count, total ms over the profiled steps)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace`` and ``--trace-steps`` of ``gradsync bench``."""
    parser.add_argument(
        "--trace",
        action="store_true",
        help="instead of measuring: profile a few steps of gradsync on 2 loopback ranks and "
        "write one Chrome/Perfetto trace per rank (OUT/trace-rank0.json, ...), then print how "
        "long gradsync's ranges took per rank (seconds; needs no matplotlib; --where and "
        "--rate-mbit do not apply)",
    )
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=3,
        help=f"with --trace: profiled steps, after {WAIT + WARMUP} warm-up ones (default 3)",
    )


def run(args: argparse.Namespace) -> int:
    """Trace on 2 loopback ranks, then print each rank's trace path and table; 0 on success."""
    from gradsync.errors import SpawnError
    from gradsync.testing.spawn import spawn

    if args.trace_steps < 1:
        print("gradsync bench: --trace-steps must be at least 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = GPTConfig(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    print(
        f"gradsync bench --trace: {WAIT + WARMUP} warm-up + {args.trace_steps} profiled steps "
        f"on {WORLD} loopback ranks",
        file=sys.stderr,
        flush=True,
    )
    try:
        ranks = spawn(
            trace_rank,
            WORLD,
            (cfg, args.batch_per_rank, args.trace_steps, str(out.resolve())),
            pg_timeout_s=min(args.timeout_s, 300.0),
            timeout_s=args.timeout_s,
        )
    except SpawnError as exc:
        print(f"gradsync bench: trace run failed: {exc}", file=sys.stderr)
        return 1
    for rank, (path, rows) in enumerate(ranks):
        print(f"\nrank {rank}: {path}")
        print(format_table(rows, args.trace_steps))
    print("\nOpen a trace at https://ui.perfetto.dev or chrome://tracing (one rank per file).")
    return 0


def trace_rank(
    rank: int, world: int, cfg: GPTConfig, batch: int, steps: int, out: str
) -> tuple[str, list[Row]]:
    """Rank body for :func:`~gradsync.testing.spawn.spawn`: train under the profiler, write
    this rank's trace; returns its path and :func:`summarize`'s rows."""
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(GPT(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)  # every rank its own batch, as in the bench
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    path = str(Path(out) / f"trace-rank{rank}.json")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
    ) as prof:
        for _ in range(WAIT + WARMUP + steps):
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            opt.step()
            prof.step()
    return path, summarize(prof.key_averages())


def summarize(events: Any) -> list[Row]:
    """Count and total ms of each of gradsync's ranges (0 where absent), then of the profiled
    steps together (every ``ProfilerStep#N``), from ``prof.key_averages()``."""
    by_name = {e.key: e for e in events}
    rows = [
        (name, by_name[name].count, by_name[name].cpu_time_total / 1e3)
        if name in by_name
        else (name, 0, 0.0)
        for name in RANGES
    ]
    steps = [e for e in events if e.key.startswith(STEP)]
    total_ms = sum(e.cpu_time_total for e in steps) / 1e3
    return [*rows, (STEP + "#* (whole steps)", sum(e.count for e in steps), total_ms)]


def format_table(rows: list[Row], steps: int) -> str:
    """A markdown table: count, total ms, ms per step and share of the steps' total."""
    step_ms = rows[-1][2] if rows and rows[-1][0].startswith(STEP) else 0.0
    over = f"{steps} step{'s' * (steps != 1)}"
    lines = [
        f"| range | count | total ms ({over}) | ms per step | % of step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, count, total in rows:
        share = f"{100 * total / step_ms:.1f}" if step_ms > 0 else "-"
        lines.append(f"| {name} | {count} | {total:.1f} | {total / steps:.2f} | {share} |")
    return "\n".join(lines)
