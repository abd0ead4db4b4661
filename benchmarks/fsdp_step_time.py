"""FSDP2 inside, gradsync across: step time against torch's own hybrid sharding, side by side.

    python benchmarks/fsdp_step_time.py                  # 2 x 2 ranks over loopback
    python benchmarks/fsdp_step_time.py --cluster        # 2 simulated nodes of 2 ranks, 1 Gbit/s

A (replicate=2, shard=2) mesh, ranks ``2 i`` and ``2 i + 1`` on node ``i``: the shard axis
within a node, the replicate axis across the link. Two variants train the same GPT (every block
its own FSDP2 group, then the root, as torchtitan lays it out) with AdamW, interleaved round by
round in the same processes:

- ``torch HSDP``: ``fully_shard`` over the 2-D (replicate, shard) mesh: FSDP2 reduce-scatters
  over shard, then all-reduces each group's shard over replicate itself;
- ``gradsync``: ``fully_shard`` over the shard axis, and
  ``gradsync.fsdp.replicate_gradients(model, mesh["replicate"])``: gradsync's all-reduce of
  each group's shard over replicate, from FSDP2's all-reduce hook, under its deadline.

Per variant: the median step time of the slowest rank over every timed step, and the ratio per
round (gradsync / torch HSDP).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from typing import Any

from gradsync.bench import launch

VARIANTS = ("torch HSDP", "gradsync")
PER_NODE = 2  # the shard axis: ranks of one node


def _build(variant: str, cfg: Any, mesh: Any) -> tuple[Any, Any, Any]:
    import torch

    from gradsync.testing import fsdp_run

    model = fsdp_run.make_model(cfg, mesh, torch.float32)
    sync = None
    if variant == "torch HSDP":
        fsdp_run.shard(model, mesh["replicate", "shard"])
    else:
        sync = fsdp_run.parallelize(model, mesh, "mean", timeout=300.0)
    return model, sync, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _time_steps(
    variant: str, cfg: Any, mesh: Any, args: argparse.Namespace, seed: int
) -> list[float]:
    """Seconds of each timed step, the slowest rank's: a barrier before, a MAX after."""
    import torch
    import torch.distributed as dist

    from gradsync.testing import fsdp_run

    model, sync, opt = _build(variant, cfg, mesh)
    rows = args.batch * mesh.size()  # the global batch: ``--batch`` sequences a rank
    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=g)
        batch = (tokens[:, :-1], tokens[:, 1:])
        dist.barrier()
        t0 = time.perf_counter()
        fsdp_run.train(model, sync, opt, [batch], mesh)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(elapsed))
    return times


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from gradsync.testing.fsdp_run import FSDPLayout
    from gradsync.testing.gpt import GPT, GPTConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    world = dist.get_world_size()
    mesh = FSDPLayout(replicate=world // PER_NODE, shard=PER_NODE).build_mesh()
    cfg = GPTConfig(
        vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios = []
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        medians = {}
        for variant in order:
            got = _time_steps(variant, cfg, mesh, args, seed=1000 * r)
            times[variant] += got
            medians[variant] = statistics.median(got)
        ratios.append(medians["gradsync"] / medians["torch HSDP"])
    if dist.get_rank() == 0:
        row: dict[str, Any] = {
            "world": world,
            "params": sum(p.numel() for p in GPT(cfg).parameters()),
        }
        row["median_s"] = {v: statistics.median(t) for v, t in times.items()}
        row["ratios"] = ratios
        row["n"] = len(times[VARIANTS[0]])
        print("FSDP_JSON " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def report(row: dict[str, Any], where: str) -> str:
    hsdp = row["median_s"]["torch HSDP"]
    ratios = sorted(row["ratios"])
    lines = [
        f"{where}: {row['world']} ranks as replicate {row['world'] // PER_NODE} x shard "
        f"{PER_NODE}, GPT {row['params'] / 1e6:.1f}M parameters, AdamW fp32, median of "
        f"{row['n']} steps per variant (slowest rank)",
        "",
        "| variant | step (ms) | vs torch HSDP |",
        "|---|---:|---:|",
    ]
    for v in VARIANTS:
        t = row["median_s"][v]
        lines.append(f"| {v} | {t * 1e3:.1f} | {t / hsdp:.3f} |")
    lines.append(
        f"\nround by round, gradsync / torch HSDP: median {statistics.median(ratios):.3f} "
        f"({', '.join(f'{x:.3f}' for x in row['ratios'])})"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    launch.add_arguments(p, rounds=6, steps=5, warmup=2, timeout_s=1500.0)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    row, where = launch.run_workers(__file__, args, "FSDP_JSON", nproc_per_node=PER_NODE)
    print(report(row, where))


if __name__ == "__main__":
    main()
