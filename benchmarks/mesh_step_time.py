"""Step time of data parallelism over a device mesh: gradsync against torch's DDP, DP2 x TP2.

    python benchmarks/mesh_step_time.py [--steps 30] [--repeats 5]

Four gloo ranks on this machine, a (dp=2, tp=2) mesh, the demo GPT with its attention and MLP
weights tensor-parallel (torch's ``parallelize_module``: DTensor parameters). Both wrappers
synchronise over ``mesh["dp"]``, the only layout torch's DDP accepts (a 1-D mesh; it swaps the
DTensor parameters for local tensors around every forward). The two run in the same processes,
alternately, ``--repeats`` times each; every figure is the median step time of the slowest rank,
and the ratio is gradsync / torch. The same run counts gradsync's all-reduces per step, against
its bucket count, and repeats gradsync on a flat group of the same 2 ranks without tensor
parallelism for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.mesh_run import Layout, make_model
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH = 8  # sequences per rank per step


def _steps(model: Any, opt: torch.optim.Optimizer, steps: int, seed: int) -> float:
    """Seconds per step (median of this rank's steps, after two warm-up steps)."""
    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(steps + 2):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(model(x), x).backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank(rank: int, world: int, steps: int, repeats: int) -> dict[str, Any]:
    mesh = Layout(dp=2, tp=2).build_mesh()
    out: dict[str, list[float]] = {"gradsync": [], "torch": []}
    calls = 0
    for r in range(repeats):
        for name in ("gradsync", "torch"):
            model = make_model(CFG, mesh, seed=0, dtype=torch.float32)
            if name == "gradsync":
                wrapped: Any = gradsync.DistributedDataParallel(model, device_mesh=mesh["dp"])
            else:
                wrapped = TorchDDP(model, device_mesh=mesh["dp"])
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            seed = 1000 * r + mesh["dp"].get_local_rank()  # the tp ranks of a replica share data
            out[name].append(_slowest(_steps(wrapped, opt, steps, seed)))
            if name == "gradsync" and r == 0:
                calls = wrapped.algorithm.stats.calls
                buckets, done = wrapped.num_buckets, wrapped.reducer.num_reductions
    return {"times": out, "calls_per_step": calls / done, "buckets": buckets}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    res = spawn(_rank, 4, (args.steps, args.repeats), timeout_s=1800)[0]
    g, t = statistics.median(res["times"]["gradsync"]), statistics.median(res["times"]["torch"])
    n_params = sum(p.numel() for p in GPT(CFG).parameters())
    print(
        f"DP2 x TP2, 4 gloo ranks, GPT {n_params / 1e6:.1f}M parameters, batch {BATCH} x "
        f"{CFG.block_size} per dp rank, AdamW, {args.steps} steps x {args.repeats} repeats"
    )
    print(f"gradsync all-reduces per step: {res['calls_per_step']:.1f} ({res['buckets']} buckets)")
    print(f"{'wrapper':<10} {'median step':>12}  runs")
    for name, med in (("gradsync", g), ("torch DDP", t)):
        runs = res["times"]["gradsync" if name == "gradsync" else "torch"]
        print(f"{name:<10} {med * 1e3:>9.1f} ms  " + " ".join(f"{x * 1e3:.0f}" for x in runs))
    print(f"ratio gradsync / torch DDP: {g / t:.3f}")


if __name__ == "__main__":
    main()
