"""bucket_cap_mb="auto" against fixed caps and torch DDP: step time, side by side.

    python benchmarks/auto_buckets.py                      # 2 ranks over loopback
    python benchmarks/auto_buckets.py --cluster            # 2 simulated nodes at 1 Gbit/s (root)

Every variant trains the same GPT with AdamW, interleaved round by round in the same processes:
``gradsync auto`` (``bucket_cap_mb="auto"``: profiles its first steps, then switches plan),
``gradsync cap C`` for fixed caps C (MiB; ``None``: one bucket), and ``torch DDP`` with its
defaults (25 MiB). Each round starts with the next variant in turn, so that none always follows
the same one, and builds every wrapper afresh, so "auto" profiles and decides again
in every round; its warm-up steps include the switch, so only steps after it are timed.

Per variant: the median step time of the slowest rank over every timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

CAPS: tuple[float | None, ...] = (1.0, 5.0, 25.0, 100.0, None)
VARIANTS = ("gradsync auto", *(f"gradsync cap {c}" for c in CAPS), "torch DDP")


def _build(variant: str, cfg: Any, lr: float) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradsync
    from gradsync.testing.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "torch DDP":
        ddp: Any = TorchDDP(model)
    elif variant == "gradsync auto":
        ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb="auto")
    else:
        cap = variant.rsplit(" ", 1)[1]
        ddp = gradsync.DistributedDataParallel(
            model, bucket_cap_mb=None if cap == "None" else float(cap)
        )
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)


def _time_steps(ddp: Any, opt: Any, cfg: Any, args: argparse.Namespace, seed: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from gradsync.testing.gpt import lm_loss

    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(ddp(x), x).backward()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        if i >= args.warmup:
            times.append(float(elapsed))
    return times


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from gradsync.ddp import autotune
    from gradsync.testing.gpt import GPTConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    # "auto" decides at the forward after its profiled steps: every timed step comes after it.
    assert args.warmup > autotune.WARMUP_STEPS + autotune.PROFILE_STEPS
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    plans, n_params = [], 0
    for r in range(args.rounds):
        shift = r % len(VARIANTS)  # each round starts with another variant: no position bias
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            ddp, opt = _build(variant, cfg, lr=1e-3)
            n_params = sum(p.numel() for p in ddp.parameters())
            times[variant] += _time_steps(ddp, opt, cfg, args, seed=1000 * r + rank)
            plan = getattr(ddp, "bucket_plan", None)
            if plan is not None:
                plans.append([plan.cap_mb, plan.first_cap_mb, plan.num_buckets,
                              plan.predicted_s])  # fmt: skip
            del ddp, opt
    if rank == 0:
        row: dict[str, Any] = {"world": world, "params": n_params, "plans": plans}
        row["median_s"] = {v: statistics.median(t) for v, t in times.items()}
        row["n"] = len(times[VARIANTS[0]])
        print("AUTO_JSON " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [__file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps)]
    argv += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
    return argv + ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]


def _run_loopback(args: argparse.Namespace) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(args.world), *_worker_argv(args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        sys.exit(proc.stdout + proc.stderr)
    return proc.stdout


def _run_cluster(args: argparse.Namespace) -> str:
    from gradsync.testing.cluster import SimulatedCluster

    ok, reason = SimulatedCluster.available()
    if not ok:
        sys.exit(f"cannot build a simulated cluster: {reason}")
    with SimulatedCluster(args.world, rate_mbit=args.rate_mbit) as cluster:
        results = cluster.launch(_worker_argv(args), 1, timeout_s=args.timeout)
    if not all(r.ok for r in results):
        sys.exit("\n".join(r.summary() for r in results))
    return results[0].stdout


def report(row: dict[str, Any], where: str) -> str:
    med = row["median_s"]
    fixed = {v: t for v, t in med.items() if v.startswith("gradsync cap")}
    best = min(fixed, key=fixed.__getitem__)
    torch_t = med["torch DDP"]
    lines = [
        f"{where}: {row['world']} ranks, GPT {row['params'] / 1e6:.1f}M parameters, AdamW fp32, "
        f"median of {row['n']} steps per variant (slowest rank)",
        "",
        f"| variant | step (ms) | vs best fixed cap ({best[9:]}) | vs torch DDP |",
        "|---|---:|---:|---:|",
    ]
    for v in VARIANTS:
        t = med[v]
        lines.append(f"| {v} | {t * 1e3:.1f} | {t / fixed[best]:.3f} | {t / torch_t:.3f} |")
    lines.append("\nplans chosen by auto (cap MiB, first cap MiB, buckets, predicted s):")
    lines += [f"  {p}" for p in row["plans"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (simulated nodes with --cluster)")
    p.add_argument("--cluster", action="store_true", help="simulated nodes instead of loopback")
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--timeout", type=float, default=290.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = _run_cluster(args) if args.cluster else _run_loopback(args)
    line = next(x for x in out.splitlines() if x.startswith("AUTO_JSON "))
    where = f"simulated cluster, {args.rate_mbit:g} Mbit/s" if args.cluster else "loopback"
    print(report(json.loads(line.split(" ", 1)[1]), where))


if __name__ == "__main__":
    main()
