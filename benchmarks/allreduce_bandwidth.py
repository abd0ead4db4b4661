"""All-reduce bus bandwidth of the gradsync algorithms on local gloo ranks (loopback).

    .venv/bin/python benchmarks/allreduce_bandwidth.py --world-sizes 2 4 --sizes-mb 1 16 64

For every world size, one set of ranks is spawned and every message size is timed with the
algorithms interleaved (native, ring, hierarchical, with the order rotated each iteration), so
slow drift on a shared machine hits them alike. Each timed iteration starts after a barrier and
counts the slowest rank's time from ``all_reduce`` to ``wait()`` returning. The table reports the
median and the bus bandwidth ``busbw = 2(N-1)/N * bytes / time``, the convention of nccl-tests:
it is the per-rank link traffic of a bandwidth-optimal all-reduce, so it can be compared across
world sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync.bench.report import bus_bandwidth
from gradsync.comm import AllReduceAlgorithm, HierarchicalAllReduce, NativeAllReduce, RingAllReduce
from gradsync.comm.ring import DEFAULT_SEGMENT_BYTES
from gradsync.testing.spawn import spawn

MB = 1 << 20


def default_local_world_size(world_size: int) -> int:
    """Two "nodes" when the ranks split evenly into halves of at least two, else one node."""
    return world_size // 2 if world_size >= 4 and world_size % 2 == 0 else world_size


def _time_once(algo: AllReduceAlgorithm, buf: torch.Tensor, src: torch.Tensor) -> float:
    buf.copy_(src)  # fresh input every time, so repeated sums never overflow
    dist.barrier()
    start = time.perf_counter()
    algo.all_reduce(buf).wait()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when the slowest rank does
    return float(elapsed.item())


def _bench_rank(
    rank: int,
    world_size: int,
    sizes_mb: list[float],
    iters: int,
    warmup: int,
    local: int,
    segment_bytes: int,
) -> dict[str, Any]:
    algos: list[AllReduceAlgorithm] = [
        NativeAllReduce(),
        RingAllReduce(segment_bytes=segment_bytes),
        HierarchicalAllReduce(local_world_size=local, segment_bytes=segment_bytes),
    ]
    results: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(rank)
    for size_mb in sizes_mb:
        numel = int(size_mb * MB) // 4
        src = torch.randn(numel, generator=gen)
        buf = torch.empty_like(src)
        times: dict[str, list[float]] = {a.name: [] for a in algos}
        for _ in range(warmup):
            for algo in algos:
                _time_once(algo, buf, src)
        for it in range(iters):
            shift = it % len(algos)
            for algo in algos[shift:] + algos[:shift]:
                times[algo.name].append(_time_once(algo, buf, src))
        results[f"{size_mb:g}"] = times
    return results


def _table(world_size: int, local: int, results: dict[str, Any]) -> list[str]:
    rows = []
    for size, times in results.items():
        nbytes = int(float(size) * MB) // 4 * 4
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        for name, median in medians.items():
            busbw = bus_bandwidth(nbytes, world_size, median) / MB
            label = f"hierarchical (L={local})" if name == "hierarchical" else name
            rows.append(
                f"| {world_size} | {size} | {label} | {median * 1e3:.1f} | {busbw:.0f} | "
                f"{medians['native'] / median:.2f} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=12, help="timed iterations per algorithm")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per algorithm")
    parser.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="ranks per node for hierarchical (default: N/2 for even N >= 4, else N)",
    )
    parser.add_argument(
        "--segment-kb",
        type=int,
        default=DEFAULT_SEGMENT_BYTES // 1024,
        help="pipeline segment of ring and hierarchical, KiB",
    )
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")

    print(
        f"torch {torch.__version__}, gloo, loopback; {args.iters} timed iterations "
        f"(+{args.warmup} warm-up) per algorithm, interleaved; median of the slowest rank; "
        f"segment {args.segment_kb} KiB; {os.cpu_count()} CPUs\n"
    )
    lines = [
        "| ranks | MB | algorithm | median ms | busbw MB/s | busbw / native |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for world_size in args.world_sizes:
        local = args.local_world_size or default_local_world_size(world_size)
        per_rank = spawn(
            _bench_rank,
            world_size,
            args=(args.sizes_mb, args.iters, args.warmup, local, args.segment_kb * 1024),
            pg_timeout_s=300.0,
            timeout_s=3600.0,
        )
        lines += _table(world_size, local, per_rank[0])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
