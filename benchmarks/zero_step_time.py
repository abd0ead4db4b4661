"""ZeRO-1: optimizer-state memory and step time of gradsync's sharded optimizer, side by side.

    python benchmarks/zero_step_time.py                      # 2 ranks over loopback
    python benchmarks/zero_step_time.py --cluster            # 2 simulated nodes at 1 Gbit/s (root)

Three variants train the same GPT with AdamW, interleaved round by round in the same processes:

- ``gradsync``: ``gradsync.DistributedDataParallel`` + ``torch.optim.AdamW`` (all-reduce, full
  optimizer state on every rank);
- ``gradsync sharded``: the same wrapper with ``model.shard_optimizer(torch.optim.AdamW)``
  (all-reduce into ``.grad``, 1/d of the state, each bucket's all-gather overlapped with the
  next bucket's step);
- ``torch ZeRO``: torch's ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``
  (all-reduce, whole parameters per rank, a broadcast per parameter after the step).

Per variant: the median step time of the slowest rank over every timed step, and the bytes of
optimizer state (every tensor in the optimizer's state) on the rank holding the most.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import timedelta
from typing import Any

from gradsync.bench import launch

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
    shape = (args.batch, cfg.block_size)
    return launch.slowest_step_times(ddp, opt, shape, cfg.vocab_size, args.warmup, args.steps, seed)


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
    launch.add_arguments(p, rounds=3, steps=6, warmup=2, timeout_s=1500.0)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    row, where = launch.run_workers(__file__, args, "ZERO_JSON")
    print(report(row, where))


if __name__ == "__main__":
    main()
