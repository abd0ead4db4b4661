"""ZeRO-1 under Recovery: what the mirror of the next rank's slices costs while nothing fails.

    python benchmarks/zero_recovery.py                       # 4 ranks over loopback
    python benchmarks/zero_recovery.py --world 4 --rounds 9 --width 1024

Two copies of the same MLP train side by side in the same processes, each wrapped by
``gradsync.DistributedDataParallel`` with ``shard_optimizer(torch.optim.AdamW)``: one in a plain
loop (ZeRO-1 alone), one inside ``Recovery.steps()`` (ZeRO-1 whose every rank also steps its
mirror of the next rank's slices: ``gradsync/optim/mirror.py``). Rounds interleave the two
(``--steps`` steps each, the order flipped every round), each timed between barriers; reported:
the median over rounds of the slowest rank's time per step, and of ``opt.step()`` alone, for
each; and the optimizer state each rank holds (its slices, its mirror) against AdamW's
unsharded state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _bytes(optim: Any) -> int:
    import torch

    return sum(
        v.numel() * v.element_size()
        for s in optim.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _rank(rank: int, world: int, cfg: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.data import GlobalBatchSampler
    from gradsync.recovery import Recovery

    torch.set_num_threads(1)
    batch, width = cfg["batch"], cfg["width"]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(batch, 1, generator=torch.Generator().manual_seed(100 + rank))
    timers: dict[str, list[float]] = {"plain": [], "recovery": []}

    def build() -> tuple[Any, Any]:
        model = _model(width, cfg["depth"])
        ddp = gradsync.DistributedDataParallel(model, reduction="item_mean", timeout=120.0)
        return ddp, ddp.shard_optimizer(torch.optim.AdamW, lr=1e-4)

    plain, plain_opt = build()
    guarded, guarded_opt = build()
    sampler = GlobalBatchSampler(range(world * 1000), world, shuffle=False)
    recovery = Recovery(guarded, guarded_opt, sampler, window=30.0)
    steps = recovery.steps()

    def one(ddp: Any, opt: Any, name: str) -> None:
        loss = ((ddp(x) - y) ** 2).sum()
        ddp.count_items(batch)
        loss.backward()
        t = time.perf_counter()
        opt.step()
        timers[name].append(time.perf_counter() - t)
        opt.zero_grad()

    def run(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(cfg["steps"]):
            if name == "plain":
                one(plain, plain_opt, name)
            else:
                with next(steps):
                    one(guarded, guarded_opt, name)
        dist.barrier()
        return (time.perf_counter() - start) / cfg["steps"]

    run("plain"), run("recovery")  # warm-up: state made, threads started
    timers = {"plain": [], "recovery": []}
    rounds: dict[str, list[float]] = {"plain": [], "recovery": []}
    for i in range(cfg["rounds"]):
        for name in ("plain", "recovery") if i % 2 == 0 else ("recovery", "plain"):
            rounds[name].append(run(name))
    per_round = torch.tensor([rounds["plain"], rounds["recovery"]])
    per_step = torch.tensor([timers["plain"], timers["recovery"]])
    for t in (per_round, per_step):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
    full = sum(p.numel() * 4 * 2 + 4 for p in guarded.module.parameters())  # AdamW, unsharded
    mirror = guarded_opt.mirror
    return {
        "step_plain_s": statistics.median(per_round[0].tolist()),
        "step_recovery_s": statistics.median(per_round[1].tolist()),
        "opt_step_plain_s": statistics.median(per_step[0].tolist()),
        "opt_step_recovery_s": statistics.median(per_step[1].tolist()),
        "state_full_bytes": full,
        "state_plain_bytes": _bytes(plain_opt.optim),
        "state_own_bytes": _bytes(guarded_opt.optim),
        "state_mirror_bytes": _bytes(mirror.optim),
        "params": sum(p.numel() for p in guarded.module.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    from gradsync.testing.spawn import spawn

    cfg = {k: getattr(args, k) for k in ("width", "depth", "batch", "steps", "rounds")}
    results = spawn(_rank, args.world, (cfg,), timeout_s=1200, pg_timeout_s=120)
    first = results[0]
    print(f"world {args.world}, {first['params'] / 1e6:.2f}M parameters (fp32 AdamW), loopback")
    ratio = first["step_recovery_s"] / first["step_plain_s"]
    print(
        f"step: ZeRO-1 {first['step_plain_s'] * 1e3:.1f} ms, under Recovery "
        f"{first['step_recovery_s'] * 1e3:.1f} ms ({ratio:.3f}x)"
    )
    ratio = first["opt_step_recovery_s"] / first["opt_step_plain_s"]
    print(
        f"opt.step(): ZeRO-1 {first['opt_step_plain_s'] * 1e3:.2f} ms, under Recovery "
        f"{first['opt_step_recovery_s'] * 1e3:.2f} ms ({ratio:.3f}x)"
    )
    for rank, r in enumerate(results):
        held = r["state_own_bytes"] + r["state_mirror_bytes"]
        print(
            f"rank {rank}: state {r['state_plain_bytes'] / 2**20:.2f} MiB without Recovery, "
            f"{held / 2**20:.2f} MiB with (own {r['state_own_bytes'] / 2**20:.2f} + mirror "
            f"{r['state_mirror_bytes'] / 2**20:.2f}) = {held / r['state_full_bytes']:.3f} of "
            f"the unsharded {r['state_full_bytes'] / 2**20:.2f} MiB (2/N = {2 / args.world:.3f})"
        )
    print(json.dumps({k: v for k, v in first.items()}, indent=None))


if __name__ == "__main__":
    main()
