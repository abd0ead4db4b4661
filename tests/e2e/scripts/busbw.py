"""Median all_reduce time of one float32 tensor, run by torchrun on every simulated node.

Used by tests/e2e/test_cluster.py only to check that a bandwidth measurement completes across
nodes; the numbers are printed, never asserted (benchmarks/cluster_busbw.py makes the claims).
Each timed call starts after a barrier and counts the slowest rank, so one rank's early start
cannot shorten it. Prints ``BUSBW size_bytes=... median_s=... busbw_MBps=...`` on rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=float, default=16.0, help="tensor size in MiB")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(args.size_mb * 2**20) // 4
    x = torch.ones(numel, dtype=torch.float32)
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(dt.item())
    median = statistics.median(times)
    busbw = 2 * (world - 1) / world * numel * 4 / median
    if rank == 0:
        print(
            f"BUSBW size_bytes={numel * 4} world={world} median_s={median:.4f} "
            f"busbw_MBps={busbw / 1e6:.1f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
