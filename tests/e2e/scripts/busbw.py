"""Median all_reduce time of one float32 tensor, run by torchrun on every simulated node.

Used by tests/e2e/test_cluster.py only to check that a bandwidth measurement completes across
nodes; the numbers are printed, never asserted (benchmarks/cluster_busbw.py makes the claims).
Timing is :func:`gradsync.testing.busbw.allreduce_times` (barrier first, slowest rank). Prints
``BUSBW size_bytes=... median_s=... busbw_MBps=...`` on rank 0.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import timedelta

import torch.distributed as dist

from gradsync.bench.report import bus_bandwidth
from gradsync.testing.busbw import allreduce_times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=float, default=16.0, help="tensor size in MiB")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(args.size_mb * 2**20) // 4
    median = statistics.median(allreduce_times(numel, args.iters, args.warmup))
    busbw = bus_bandwidth(numel * 4, world, median)
    if rank == 0:
        print(
            f"BUSBW size_bytes={numel * 4} world={world} median_s={median:.4f} "
            f"busbw_MBps={busbw / 1e6:.1f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
