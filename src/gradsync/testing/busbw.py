"""The timing loop behind every all-reduce bus-bandwidth number (bench, benchmarks, e2e tests).

Each timed call starts after a barrier and lasts as long as its slowest rank (a MAX all-reduce of
the elapsed times), so a rank that starts early cannot shorten it. Turning times into bus
bandwidth, and the ring bound to compare it with, is :mod:`gradsync.bench.report`'s job
(:func:`~gradsync.bench.report.bus_bandwidth`, :func:`~gradsync.bench.report.ring_bound_s`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def allreduce_times(numel: int, iters: int, warmup: int) -> list[float]:
    """Seconds of ``iters`` all-reduces of one float32 tensor of ``numel`` elements, each the
    slowest rank's, after ``warmup`` untimed ones. Collective: every rank calls it alike."""
    x = torch.ones(numel, dtype=torch.float32)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return times
