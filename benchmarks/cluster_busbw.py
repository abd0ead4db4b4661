"""Native gloo all_reduce bus bandwidth on a simulated cluster, against the ring bound.

Run as root: ``python benchmarks/cluster_busbw.py [--nodes 2] [--rate-mbit 1000]``. It builds a
:class:`gradsync.testing.cluster.SimulatedCluster`, launches itself there with torchrun
(``--worker``), and prints a markdown table.

Why these choices (the pitfalls are numbered in :mod:`gradsync.testing.cluster`):

* Sizes of 16 MiB and more: the tbf burst (~2 ms of bytes, pitfall 4) lets that much through
  unthrottled, so small messages can look faster than the link (claims are made on >= 16 MB).
* The bound uses the TCP payload rate, 1448/1514 = 95.6 % of the tc rate (pitfall 5): a ring
  all-reduce moves 2(N-1)/N x bytes over each link direction, so it needs at least
  ``2(N-1)/N * bytes / payload_rate`` seconds; ``ratio`` = bound / measured (1.0 = at the bound).
  The formulas are :mod:`gradsync.bench.report`'s.
* Each timed call starts after a barrier and counts its slowest rank
  (:func:`gradsync.testing.busbw.allreduce_times`); the median over ``--iters`` runs after
  ``--warmup`` untimed ones is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import timedelta

MIB = 2**20


def worker(sizes_mib: list[int], iters: int, warmup: int) -> None:
    """Runs on every rank: time all_reduce per size, print one JSON line per size on rank 0."""
    import torch.distributed as dist

    from gradsync.testing.busbw import allreduce_times

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    for size in sizes_mib:
        times = allreduce_times(size * MIB // 4, iters, warmup)
        if rank == 0:
            row = {"size_mib": size, "world": world, "median_s": statistics.median(times)}
            row |= {"min_s": min(times), "max_s": max(times), "n": len(times)}
            print("BUSBW_JSON " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    from gradsync.bench.report import bus_bandwidth, payload_rate, ring_bound_s
    from gradsync.testing.cluster import SimulatedCluster

    ok, reason = SimulatedCluster.available()
    if not ok:
        print(f"cannot build a simulated cluster: {reason}", file=sys.stderr)
        return 2
    argv = [__file__, "--worker", "--iters", str(args.iters), "--warmup", str(args.warmup)]
    argv += ["--sizes-mib", *map(str, args.sizes_mib)]
    with SimulatedCluster(args.nodes, rate_mbit=args.rate_mbit) as cluster:
        results = cluster.launch(argv, args.nproc_per_node, timeout_s=args.timeout)
    if not all(r.ok for r in results):
        for r in results:
            print(r.summary(), file=sys.stderr)
        return 1
    rows = [
        json.loads(line.split(" ", 1)[1])
        for line in results[0].stdout.splitlines()
        if line.startswith("BUSBW_JSON ")
    ]
    payload = payload_rate(args.rate_mbit)  # bytes/s of TCP payload per link
    world = args.nodes * args.nproc_per_node
    print(
        f"gloo all_reduce, float32, {args.nodes} nodes x {args.nproc_per_node} rank(s), "
        f"{args.rate_mbit:g} Mbit/s per link direction (payload {payload / 1e6:.1f} MB/s), "
        f"median of {args.iters} after {args.warmup} warm-up\n"
    )
    print("| size | median time (s) | bus bw (MB/s) | ring bound (s) | ratio (bound/time) |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        nbytes = row["size_mib"] * MIB
        bound = ring_bound_s(nbytes, world, payload)
        busbw = bus_bandwidth(nbytes, world, row["median_s"]) / 1e6
        print(
            f"| {row['size_mib']} MiB | {row['median_s']:.3f} | {busbw:.1f} | {bound:.3f} "
            f"| {bound / row['median_s']:.3f} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--iters", type=int, default=7, help="timed runs per size (>= 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.sizes_mib, args.iters, args.warmup)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
