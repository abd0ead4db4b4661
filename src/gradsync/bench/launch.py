"""Running a benchmark script's worker under torchrun, on loopback or on a simulated cluster,
and timing its training steps.

Benchmarks that compare variants in one run (``benchmarks/*_step_time.py``) start themselves
again with a ``--worker`` flag on every rank and read back one JSON line from rank 0. Both
settings share this launching code: loopback is ``torchrun --standalone`` on this machine; the
cluster is :class:`~gradsync.testing.cluster.SimulatedCluster` (network namespaces, links shaped
to ``rate_mbit``; needs root), one rank per simulated node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any


def on_loopback(worker_argv: list[str], nproc: int, timeout_s: float) -> str:
    """Run ``worker_argv`` (a script and its flags) on ``nproc`` local ranks; rank 0's stdout.
    Exits with the workers' output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), *worker_argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        sys.exit(proc.stdout + proc.stderr)
    return proc.stdout


def on_cluster(
    worker_argv: list[str], nodes: int, rate_mbit: float, timeout_s: float, nproc_per_node: int = 1
) -> str:
    """Run ``worker_argv`` on ``nodes`` simulated nodes, ``nproc_per_node`` ranks each; node 0's
    stdout."""
    from gradsync.testing.cluster import SimulatedCluster

    ok, reason = SimulatedCluster.available()
    if not ok:
        sys.exit(f"cannot build a simulated cluster: {reason}")
    with SimulatedCluster(nodes, rate_mbit=rate_mbit) as cluster:
        results = cluster.launch(worker_argv, nproc_per_node, timeout_s=timeout_s)
    if not all(r.ok for r in results):
        sys.exit("\n".join(r.summary() for r in results))
    return results[0].stdout


def json_line(stdout: str, tag: str) -> dict[str, Any]:
    """The JSON object rank 0 printed after ``tag`` (e.g. ``"ZERO_JSON"``)."""
    line = next(x for x in stdout.splitlines() if x.startswith(tag + " "))
    return dict(json.loads(line.split(" ", 1)[1]))


def slowest_step_times(
    model: Any,
    optimizer: Any,
    shape: tuple[int, int],
    vocab_size: int,
    warmup: int,
    steps: int,
    seed: int,
) -> list[float]:
    """Seconds of each of ``steps`` language-model training steps (after ``warmup``), each the
    slowest rank's: a barrier before, a MAX all-reduce of the elapsed time after."""
    import torch
    import torch.distributed as dist

    from gradsync.testing.gpt import lm_loss

    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, vocab_size, shape, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        lm_loss(model(x), x).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return times


def add_arguments(
    parser: argparse.ArgumentParser, *, rounds: int, steps: int, warmup: int, timeout_s: float
) -> None:
    """The flags every such benchmark shares: where it runs, how long, the model's size."""
    parser.add_argument("--world", type=int, default=2, help="ranks (simulated nodes: --cluster)")
    parser.add_argument("--cluster", action="store_true", help="simulated nodes, not loopback")
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--timeout", type=float, default=timeout_s)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run_workers(
    script: str,
    args: argparse.Namespace,
    tag: str,
    extra: list[str] | None = None,
    nproc_per_node: int = 1,
) -> tuple[dict[str, Any], str]:
    """Start ``script --worker`` with the shared flags where ``args`` say (and the script's own
    ``extra`` flags), ``nproc_per_node`` ranks on each of ``--world`` nodes (on loopback: all
    on this machine); rank 0's JSON line after ``tag``, and a phrase saying where it ran."""
    argv = [script, "--worker", *(extra or []), "--rounds", str(args.rounds)]
    argv += ["--steps", str(args.steps)]
    argv += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
    argv += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    if args.cluster:
        out = on_cluster(argv, args.world, args.rate_mbit, args.timeout, nproc_per_node)
        return json_line(out, tag), f"simulated cluster, {args.rate_mbit:g} Mbit/s"
    nproc = args.world * nproc_per_node
    return json_line(on_loopback(argv, nproc, args.timeout), tag), "loopback"
