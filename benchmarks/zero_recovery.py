"""ZeRO-1 under Recovery: what the mirror of the next rank's slices costs while nothing fails.

    python benchmarks/zero_recovery.py                       # 4 ranks over loopback
    python benchmarks/zero_recovery.py --world 4 --rounds 25 --steps 3 --width 1024
    python benchmarks/zero_recovery.py --model gpt           # the main job's GPT instead

Two copies of the same model train side by side in the same processes, each wrapped by
``gradsync.DistributedDataParallel`` with ``shard_optimizer(torch.optim.AdamW)``: one in a plain
loop (ZeRO-1 alone), one inside ``Recovery.steps()`` (ZeRO-1 whose every rank also steps its
mirror of the next rank's slices: ``gradsync/optim/mirror.py``). Rounds interleave the two
(``--steps`` steps each, the order flipped every round), each timed between barriers.

Reported: the median over rounds of the slowest rank's time per step for each, their ratio,
and the median of each round's own ratio (a round and its neighbour share the machine's load:
the paired ratio is the steadier one where other jobs share the cores); the same for the
process's CPU time per step (every thread: gloo's, the gathers' worker, the heartbeat),
summed over the ranks. Then where a step's time goes on each replica, per rank (the medians
over rounds of each piece's wall and CPU time per step, the CPU time the main thread's): the
forward and backward, ``opt.step()`` and, inside it, the agreement, the owner's inner
optimizer steps (one per bucket), the mirror's take of the parameters at the step's start,
its optimizer step, the wait for the gathers and the comparison with the owner's result. The
pieces are timed by wrapping the methods of the two replicas' own objects (never the classes):
a few microseconds a step. Last, the optimizer state each rank holds (its slices, its mirror)
against AdamW's unsharded state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

PIECES = (
    "forward + backward",
    "opt.step()",
    "  agreement (check_step)",
    "  owner's AdamW, per bucket",
    "  mirror: take the step's start",
    "  mirror: AdamW",
    "  wait for the gathers",
    "  mirror: compare",
    "Recovery's step bookkeeping",
)


def _workload(
    cfg: dict[str, Any], rank: int
) -> tuple[Callable[[], Any], Callable[[Any], Any], int]:
    """(a new model, its loss on this rank's batch, the items in it) for ``--model``: the MLP,
    where AdamW over a quarter of the parameters is a large share of the step (about 7 %),
    or the GPT of the main job, where a step's compute per parameter is a language model's."""
    import torch
    from torch import nn

    from gradsync.testing.gpt import GPT, GPTConfig, lm_loss

    batch, width = cfg["batch"], cfg["width"]
    g = torch.Generator().manual_seed(rank)
    if cfg["model"] == "gpt":
        gpt = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=256)
        tokens = torch.randint(0, gpt.vocab_size, (batch, gpt.block_size), generator=g)

        def language_model() -> nn.Module:
            torch.manual_seed(0)  # each replica the same weights, as the MLP's
            return GPT(gpt)

        return language_model, lambda m: lm_loss(m(tokens), tokens, "sum"), tokens.numel()

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(cfg["depth"]):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(width, 1))

    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, 1, generator=torch.Generator().manual_seed(100 + rank))
    return mlp, lambda m: ((m(x) - y) ** 2).sum(), batch


class Pieces:
    """Wall and main-thread CPU time per piece, summed until :meth:`take`."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def wrap(self, obj: Any, attr: str, piece: str) -> None:
        """Time every call of ``obj.attr`` (an instance attribute: this object only)."""
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sums[piece][0] += time.perf_counter() - wall
                self.sums[piece][1] += time.thread_time() - cpu

        setattr(obj, attr, timed)

    def take(self) -> dict[str, tuple[float, float]]:
        out = {k: (w, c) for k, (w, c) in self.sums.items()}
        self.sums.clear()
        return out


def _instrument(pieces: Pieces, ddp: Any, opt: Any, recovery: Any) -> None:
    steps = ddp.sharded_steps
    pieces.wrap(steps, "step", "opt.step()")
    pieces.wrap(opt, "check_step", "  agreement (check_step)")
    pieces.wrap(opt.optim, "step", "  owner's AdamW, per bucket")
    pieces.wrap(steps, "wait_all", "  wait for the gathers")
    mirror = opt.mirror
    if mirror is not None:
        for mb in mirror.buckets:
            pieces.wrap(mb, "take", "  mirror: take the step's start")
        # before 2026-12-07 the mirror stepped bucket by bucket (step_bucket)
        pieces.wrap(mirror, "step" if hasattr(mirror, "step") else "step_bucket", "  mirror: AdamW")
        pieces.wrap(mirror, "compare", "  mirror: compare")
    if recovery is not None:
        pieces.wrap(recovery, "_begin", "Recovery's step bookkeeping")
        pieces.wrap(recovery, "_completed", "Recovery's step bookkeeping")


def _rank(rank: int, world: int, cfg: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.data import GlobalBatchSampler
    from gradsync.optim.mirror import state_bytes
    from gradsync.recovery import Recovery

    torch.set_num_threads(1)
    make, loss_of, items = _workload(cfg, rank)

    def build() -> tuple[Any, Any]:
        model = make()
        ddp = gradsync.DistributedDataParallel(model, reduction="item_mean", timeout=120.0)
        return ddp, ddp.shard_optimizer(torch.optim.AdamW, lr=1e-4)

    plain, plain_opt = build()
    guarded, guarded_opt = build()
    sampler = GlobalBatchSampler(range(world * 1000), world, shuffle=False)
    recovery = Recovery(guarded, guarded_opt, sampler, window=30.0)
    pieces = {"plain": Pieces(), "recovery": Pieces()}
    _instrument(pieces["plain"], plain, plain_opt, None)
    _instrument(pieces["recovery"], guarded, guarded_opt, recovery)
    steps = recovery.steps()

    def one(ddp: Any, opt: Any, timed: Pieces) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        loss = loss_of(ddp)
        ddp.count_items(items)
        loss.backward()
        timed.sums["forward + backward"][0] += time.perf_counter() - wall
        timed.sums["forward + backward"][1] += time.thread_time() - cpu
        opt.step()
        opt.zero_grad()

    def run(name: str) -> tuple[float, float, dict[str, tuple[float, float]]]:
        n = cfg["steps"]
        pieces[name].take()
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            if name == "plain":
                one(plain, plain_opt, pieces[name])
            else:
                with next(steps):
                    one(guarded, guarded_opt, pieces[name])
        dist.barrier()
        wall, cpu = (time.perf_counter() - start) / n, (time.process_time() - cpu) / n
        return wall, cpu, {k: (w / n, c / n) for k, (w, c) in pieces[name].take().items()}

    run("plain"), run("recovery")  # warm-up: state made, threads started
    rounds: dict[str, list[Any]] = {"plain": [], "recovery": []}
    for i in range(cfg["rounds"]):
        for name in ("plain", "recovery") if i % 2 == 0 else ("recovery", "plain"):
            rounds[name].append(run(name))
    result = _summary(rounds)
    full = sum(p.numel() * 4 * 2 + 4 for p in guarded.module.parameters())  # AdamW, unsharded
    return {
        **result,
        "state_full_bytes": full,
        "state_plain_bytes": state_bytes(plain_opt.optim),
        "state_own_bytes": state_bytes(guarded_opt.optim),
        "state_mirror_bytes": state_bytes(guarded_opt.mirror.optim),
        "params": sum(p.numel() for p in guarded.module.parameters()),
        "model": cfg["model"],
    }


def _summary(rounds: dict[str, list[Any]]) -> dict[str, Any]:
    """The slowest rank's wall time and every rank's CPU time, per round; this rank's pieces."""
    import torch
    import torch.distributed as dist

    wall = torch.tensor([[r[0] for r in rounds[n]] for n in ("plain", "recovery")])
    cpu = torch.tensor([[r[1] for r in rounds[n]] for n in ("plain", "recovery")])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)  # the job's CPU time: every rank's
    out: dict[str, Any] = {}
    for what, t in (("step", wall), ("cpu", cpu)):
        out[f"{what}_plain_s"] = statistics.median(t[0].tolist())
        out[f"{what}_recovery_s"] = statistics.median(t[1].tolist())
        out[f"{what}_paired_ratio"] = statistics.median((t[1] / t[0]).tolist())
    for name in ("plain", "recovery"):
        out[f"pieces_{name}"] = {
            piece: tuple(
                statistics.median(r[2].get(piece, (0.0, 0.0))[k] for r in rounds[name])
                for k in (0, 1)
            )
            for piece in PIECES
        }
    return out


def _report(results: list[dict[str, Any]], world: int) -> None:
    first = results[0]
    print(
        f"world {world}, {first['model']}, {first['params'] / 1e6:.2f}M parameters (fp32 AdamW), "
        "loopback"
    )
    for what, label in (("step", "step (slowest rank)"), ("cpu", "CPU time (all ranks)")):
        plain, guarded = first[f"{what}_plain_s"], first[f"{what}_recovery_s"]
        print(
            f"{label}: ZeRO-1 {plain * 1e3:.1f} ms, under Recovery {guarded * 1e3:.1f} ms "
            f"({guarded / plain:.3f}x; paired by round {first[f'{what}_paired_ratio']:.3f}x)"
        )
    print("\nper step, ms (wall | main thread's CPU), medians over rounds")
    print(f"| piece | {' | '.join(f'rank {r} ZeRO-1 | rank {r} Recovery' for r in range(world))} |")
    print(f"|---|{'---:|' * 2 * world}")
    for piece in PIECES:
        cells = [
            f"{w * 1e3:.2f} \\| {c * 1e3:.2f}"
            for r in results
            for w, c in (r["pieces_plain"][piece], r["pieces_recovery"][piece])
        ]
        print(f"| {piece.strip()} | {' | '.join(cells)} |")
    print()
    for rank, r in enumerate(results):
        held = r["state_own_bytes"] + r["state_mirror_bytes"]
        print(
            f"rank {rank}: state {r['state_plain_bytes'] / 2**20:.2f} MiB without Recovery, "
            f"{held / 2**20:.2f} MiB with (own {r['state_own_bytes'] / 2**20:.2f} + mirror "
            f"{r['state_mirror_bytes'] / 2**20:.2f}) = {held / r['state_full_bytes']:.3f} of "
            f"the unsharded {r['state_full_bytes'] / 2**20:.2f} MiB (2/N = {2 / world:.3f})"
        )
    print(json.dumps({k: v for k, v in first.items() if not k.startswith("pieces")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, help="rows (mlp: 32) or sequences (gpt: 4) a rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    from gradsync.testing.spawn import spawn

    if args.batch is None:
        args.batch = 4 if args.model == "gpt" else 32
    cfg = {k: getattr(args, k) for k in ("model", "width", "depth", "batch", "steps", "rounds")}
    results = spawn(_rank, args.world, (cfg,), timeout_s=1200, pg_timeout_s=120)
    _report(results, args.world)


if __name__ == "__main__":
    main()
