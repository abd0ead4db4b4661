"""bucket_cap_mb="auto" against fixed caps and torch DDP: step time, side by side.

    python benchmarks/auto_buckets.py                      # 2 ranks over loopback
    python benchmarks/auto_buckets.py --cluster            # 2 simulated nodes at 1 Gbit/s (root)

Every variant trains the same GPT with AdamW, interleaved round by round in the same processes:
``gradsync auto`` (``bucket_cap_mb="auto"``: profiles its first steps, then switches plan),
``gradsync default`` (torch's 25 MiB on one host, ``"scaled"`` across hosts: an eighth of
the gradient bytes, 1 to 25 MiB),
``gradsync cap C`` for fixed caps C (MiB; ``None``: one bucket), and ``torch DDP`` with its
defaults (25 MiB). Each round starts with the next variant in turn, so that none always follows
the same one, and builds every wrapper afresh, so "auto" profiles and decides again
in every round; its warm-up steps include the switch, so only steps after it are timed.

Per variant: the median step time of the slowest rank over every timed step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import timedelta
from typing import Any

from gradsync.bench import launch

CAPS: tuple[float | None, ...] = (1.0, 5.0, 25.0, 100.0, None)
VARIANTS = ("gradsync auto", "gradsync default", *(f"gradsync cap {c}" for c in CAPS), "torch DDP")


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
    elif variant == "gradsync default":
        ddp = gradsync.DistributedDataParallel(model)
    else:
        cap = variant.rsplit(" ", 1)[1]
        ddp = gradsync.DistributedDataParallel(
            model, bucket_cap_mb=None if cap == "None" else float(cap)
        )
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)


def _time_steps(ddp: Any, opt: Any, cfg: Any, args: argparse.Namespace, seed: int) -> list[float]:
    shape = (args.batch, cfg.block_size)
    return launch.slowest_step_times(ddp, opt, shape, cfg.vocab_size, args.warmup, args.steps, seed)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from gradsync.ddp.replan import autotune
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
    launch.add_arguments(p, rounds=4, steps=4, warmup=6, timeout_s=290.0)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    row, where = launch.run_workers(__file__, args, "AUTO_JSON")
    print(report(row, where))


if __name__ == "__main__":
    main()
