"""Step time of gradsync against torch DDP and the naive loop, on 2 gloo ranks over loopback.

    python benchmarks/ddp_step_time.py                 # ~20M-parameter GPT, 2 ranks
    python benchmarks/ddp_step_time.py --rounds 20 --world 2

Prints the median step time of each variant and its ratio to torch's DistributedDataParallel,
all measured interleaved in one run (see gradsync/bench/steptime.py).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch

from gradsync.bench.steptime import (
    DEFAULT_VARIANTS,
    StepTimeConfig,
    Variant,
    markdown_table,
    num_parameters,
    run_rank,
    summarize,
)
from gradsync.testing.spawn import spawn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda uses nccl")
    p.add_argument(
        "--with-local", action="store_true", help="also time a step with no communication"
    )
    args = p.parse_args()
    variants = DEFAULT_VARIANTS + (
        (Variant("no sync (local)", "local"),) if args.with_local else ()
    )
    cfg = StepTimeConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        batch_per_rank=args.batch_per_rank,
        rounds=args.rounds,
        warmup=args.warmup,
        block_size=args.block_size,
        device=args.device,
        variants=variants,
    )
    n = num_parameters(cfg)
    print(
        f"{datetime.date.today()} | {platform.machine()}, torch {torch.__version__}, "
        f"{args.device}, {'nccl' if args.device == 'cuda' else 'gloo over loopback'}, "
        f"{args.world} ranks x 1 thread | GPT {n / 1e6:.1f}M parameters, batch "
        f"{cfg.batch_per_rank}x{cfg.block_size} per rank | {cfg.rounds} rounds after "
        f"{cfg.warmup} warm-up"
    )
    backend = "nccl" if args.device == "cuda" else "gloo"
    times = spawn(run_rank, args.world, (cfg,), pg_timeout_s=300, timeout_s=3600, backend=backend)[
        0
    ]
    baseline = "torch DDP default"
    print(markdown_table(summarize(times, baseline), baseline))


if __name__ == "__main__":
    main()
