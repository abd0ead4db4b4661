"""ZeRO-1: optimizer-state memory and step time of gradsync's sharded optimizer, side by side.

    python benchmarks/zero_step_time.py                      # 2 ranks over loopback
    python benchmarks/zero_step_time.py --cluster            # 2 simulated nodes at 1 Gbit/s (root)

Three variants train the same GPT with AdamW, interleaved round by round in the same processes:

- ``gradsync``: ``gradsync.DistributedDataParallel`` + ``torch.optim.AdamW`` (all-reduce, full
  optimizer state on every rank);
- ``gradsync sharded``: the same wrapper with ``model.shard_optimizer(torch.optim.AdamW)``
  (reduce-scatter, 1/d of the state, all-gather overlapped with the next forward);
- ``torch ZeRO``: torch's ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``
  (all-reduce, whole parameters per rank, a broadcast per parameter after the step).

Per variant: the median step time of the slowest rank over every timed step, and the bytes of
optimizer state (every tensor in the optimizer's state) on the rank holding the most.
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

VARIANTS = ("gradsync", "gradsync sharded", "torch ZeRO")


def _build(variant: str, cfg: Any, lr: float) -> tuple[Any, Any]:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradsync
    from gradsync.testing.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "torch ZeRO":
        ddp: Any = TorchDDP(model)
        opt: Any = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=lr)
        return ddp, opt
    ddp = gradsync.DistributedDataParallel(model)
    if variant == "gradsync sharded":
        return ddp, ddp.shard_optimizer(torch.optim.AdamW, lr=lr)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)


def _state_bytes(opt: Any) -> int:
    inner = getattr(opt, "optim", opt)  # both sharded optimizers keep a local one
    return sum(
        t.numel() * t.element_size()
        for s in inner.state.values()
        for t in s.values()
        if hasattr(t, "dim") and t.dim() > 0
    )


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
    import torch
    import torch.distributed as dist

    from gradsync.testing.gpt import GPTConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    state: dict[str, int] = {}
    n_params = 0
    for r in range(args.rounds):
        for variant in VARIANTS:
            ddp, opt = _build(variant, cfg, lr=1e-3)
            n_params = sum(p.numel() for p in ddp.parameters())
            times[variant] += _time_steps(ddp, opt, cfg, args, seed=1000 * r + rank)
            mine = torch.tensor([_state_bytes(opt)])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            state[variant] = int(mine)
            del ddp, opt
    if rank == 0:
        row = {"world": world, "params": n_params, "state": state}
        row["median_s"] = {v: statistics.median(t) for v, t in times.items()}
        row["n"] = len(times[VARIANTS[0]])
        print("ZERO_JSON " + json.dumps(row), flush=True)
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
    base_t, base_m = row["median_s"]["gradsync"], row["state"]["gradsync"]
    zero_t = row["median_s"]["torch ZeRO"]
    lines = [
        f"{where}: {row['world']} ranks, GPT {row['params'] / 1e6:.1f}M parameters, AdamW fp32, "
        f"median of {row['n']} steps per variant (slowest rank)",
        "",
        "| variant | step (ms) | vs gradsync | vs torch ZeRO | optimizer state (MiB, max rank) "
        "| vs gradsync |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        t, m = row["median_s"][v], row["state"][v]
        lines.append(
            f"| {v} | {t * 1e3:.1f} | {t / base_t:.3f} | {t / zero_t:.3f} | {m / 2**20:.2f} "
            f"| {m / base_m:.3f} |"
        )
    lines.append(f"\n1/d = {1 / row['world']:.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (simulated nodes with --cluster)")
    p.add_argument("--cluster", action="store_true", help="2 simulated nodes instead of loopback")
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = _run_cluster(args) if args.cluster else _run_loopback(args)
    line = next(x for x in out.splitlines() if x.startswith("ZERO_JSON "))
    where = f"simulated cluster, {args.rate_mbit:g} Mbit/s" if args.cluster else "loopback"
    print(report(json.loads(line.split(" ", 1)[1]), where))


if __name__ == "__main__":
    main()
