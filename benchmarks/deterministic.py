"""The deterministic mode's cost: step time and bytes against the default mode and torch DDP.

    python benchmarks/deterministic.py --world 3                    # 3 ranks over loopback
    python benchmarks/deterministic.py --world 3 --cluster          # 3 simulated nodes, 1 Gbit/s

Three variants train the same GPT on the same steps of ``--leaves`` leaves of one sequence each,
interleaved round by round in the same processes; each rank runs its block of leaves
(``gradsync.data.leaf_range``) as micro-batches, ``no_sync()`` on all but the last, so every
variant computes the same thing and only the reduction differs:

- ``torch DDP``: torch's ``DistributedDataParallel`` (an all-reduce per bucket);
- ``gradsync``: the default mode (an all-reduce per bucket);
- ``gradsync deterministic``: ``deterministic=leaves`` (the fixed leaf tree: a scatter of each
  rank's pieces, a combine, a gather; ``gradsync/comm/tree_exchange.py``).

Per variant: the median step time of the slowest rank over every timed step; the median CPU
time of a step (every thread of the process, the most of any rank): the host's work, which a
machine shared with other jobs inflates less than the time; the gradient bytes each rank hands
the wire per step (max rank): what the exchange counts for the deterministic mode, a ring
all-reduce's ``2 (N-1)/N`` of the gradients for the others; on a simulated cluster also the
bytes the busiest node's link actually sent per step (``/proc/net/dev`` in its namespace:
every collective, headers included).

With ``--zero`` the variants are ZeRO-1 (``shard_optimizer(AdamW)``, clipped every step by
``opt.clip_grad_norm_``) in the default and in the deterministic mode, the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from datetime import timedelta
from typing import Any

from gradsync.bench import launch

VARIANTS = ("torch DDP", "gradsync", "gradsync deterministic")
ZERO_VARIANTS = ("gradsync ZeRO-1", "gradsync deterministic ZeRO-1")


def _build(variant: str, cfg: Any, leaves: int) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradsync
    from gradsync.testing.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "torch DDP":
        ddp: Any = TorchDDP(model)
    else:
        fixed = leaves if "deterministic" in variant else None
        ddp = gradsync.DistributedDataParallel(model, reduction="item_mean", deterministic=fixed)
    if "ZeRO-1" in variant:
        return ddp, ddp.shard_optimizer(torch.optim.AdamW, lr=1e-3)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def _sent_bytes() -> int:
    """Bytes this network namespace's interfaces sent, loopback excepted."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() != "lo":
                total += int(data.split()[8])
    return total


def _payload(ddp: Any) -> int:
    hook = getattr(getattr(ddp, "reducer", None), "comm_hook", None)
    stats = getattr(hook, "stats", None)
    return stats.bytes_sent if stats is not None else 0


def _time_steps(ddp: Any, opt: Any, cfg: Any, args: argparse.Namespace, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from gradsync.data import leaf_range
    from gradsync.testing.gpt import lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = leaf_range(args.leaves, world, rank)
    g = torch.Generator().manual_seed(seed)
    times, wire, payload, cpus = [], [], [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.leaves, 1, cfg.block_size), generator=g)
        dist.barrier()
        sent, counted, t0 = _sent_bytes(), _payload(ddp), time.perf_counter()
        cpu0 = time.process_time()  # every thread of the process: gloo's and gradsync's too
        opt.zero_grad()
        for j, leaf in enumerate(mine):
            last = j == len(mine) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = lm_loss(ddp(x[leaf]), x[leaf], reduction="sum")
                if hasattr(ddp, "count_items"):
                    ddp.count_items(cfg.block_size)
                loss.backward()
        if hasattr(opt, "clip_grad_norm_"):  # ZeRO-1: clipped, as jobs that shard clip
            opt.clip_grad_norm_(1.0)
        opt.step()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        row = torch.tensor([elapsed, _payload(ddp) - counted, _sent_bytes() - sent, cpu])
        dist.all_reduce(row, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(row[0]))
            payload.append(float(row[1]))
            wire.append(float(row[2]))
            cpus.append(float(row[3]))
    return {"times": times, "payload": payload, "wire": wire, "cpu": cpus}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from gradsync.testing.gpt import GPTConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    variants = ZERO_VARIANTS if args.zero else VARIANTS
    out: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    n_params = 0
    for r in range(args.rounds):
        for variant in variants:
            ddp, opt = _build(variant, cfg, args.leaves)
            n_params = sum(p.numel() for p in ddp.parameters())
            got = _time_steps(ddp, opt, cfg, args, seed=1000 * r)
            for key, values in got.items():
                out[variant].setdefault(key, []).extend(values)
            del ddp, opt
    if rank == 0:
        row: dict[str, Any] = {"world": world, "params": n_params, "leaves": args.leaves}
        for v in variants:
            row[v] = {k: statistics.median(vals) for k, vals in out[v].items()}
        row["n"] = len(out[variants[0]]["times"])
        print("DET_JSON " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def zero_report(row: dict[str, Any], where: str) -> str:
    """The ``--zero`` table: deterministic ZeRO-1 against the default mode's ZeRO-1."""
    base = row[ZERO_VARIANTS[0]]["times"]
    lines = [
        f"{where}: {row['world']} ranks, GPT {row['params'] / 1e6:.2f}M parameters (fp32), "
        f"AdamW sharded and clipped, {row['leaves']} leaves of 1 sequence per step, median of "
        f"{row['n']} steps per variant (slowest rank)",
        "",
        "| variant | step (ms) | vs ZeRO-1 |",
        "|---|---:|---:|",
    ]
    for v in ZERO_VARIANTS:
        t = row[v]["times"]
        lines.append(f"| {v} | {t * 1e3:.1f} | {t / base:.3f} |")
    return "\n".join(lines)


def report(row: dict[str, Any], where: str, cluster: bool) -> str:
    from gradsync.comm.tree import dyadic_pieces, leaf_range

    n, leaves = row["world"], row["leaves"]
    grad_bytes = 4 * row["params"]
    ring = 2 * (n - 1) / n * grad_bytes
    blocks = [leaf_range(leaves, n, r) for r in range(n)]
    pieces = [len(dyadic_pieces(b.start, b.stop)) for b in blocks]
    base, torch_t = row["gradsync"]["times"], row["torch DDP"]["times"]
    lines = [
        f"{where}: {n} ranks, GPT {row['params'] / 1e6:.2f}M parameters (fp32), {leaves} leaves "
        f"of 1 sequence per step (pieces per rank: {pieces}), median of {row['n']} steps per "
        "variant (slowest rank)",
        "",
        "| variant | step (ms) | vs gradsync | vs torch DDP | CPU per step (ms, max rank) | vs "
        "gradsync | gradient bytes sent per step (MiB, max rank) | vs a ring all-reduce |"
        + (" link bytes sent per step (MiB, max node) |" if cluster else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if cluster else ""),
    ]
    base_cpu = row["gradsync"]["cpu"]
    for v in VARIANTS:
        t = row[v]["times"]
        sent = row[v]["payload"] if "deterministic" in v else ring
        cpu = row[v]["cpu"]
        line = (
            f"| {v} | {t * 1e3:.1f} | {t / base:.3f} | {t / torch_t:.3f} | {cpu * 1e3:.1f} "
            f"| {cpu / base_cpu:.3f} | {sent / 2**20:.2f} | {sent / ring:.3f} |"
        )
        if cluster:
            line += f" {row[v]['wire'] / 2**20:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    launch.add_arguments(p, rounds=3, steps=5, warmup=2, timeout_s=1500.0)
    p.add_argument("--leaves", type=int, default=16, help="leaves (sequences) per step")
    p.add_argument("--zero", action="store_true", help="ZeRO-1 in both modes instead")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    extra = ["--leaves", str(args.leaves), *(["--zero"] if args.zero else [])]
    row, where = launch.run_workers(__file__, args, "DET_JSON", extra)
    print(zero_report(row, where) if args.zero else report(row, where, args.cluster))


if __name__ == "__main__":
    main()
