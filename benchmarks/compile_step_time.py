"""Step time of a torch.compile'd model under gradsync and under torch DDP, side by side.

    python benchmarks/compile_step_time.py --cluster         # 2 simulated nodes at 1 Gbit/s (root)
    python benchmarks/compile_step_time.py                   # 2 ranks over loopback
    python benchmarks/compile_step_time.py --backend aot_eager   # no inductor codegen (faster)
    python benchmarks/compile_step_time.py --cluster --bucket-cap-mb 3.4   # the same buckets
    python benchmarks/compile_step_time.py --cluster --no-ddp-optimizer    # no overlap

Four variants train the same GPT with AdamW, each wrapper with its default settings (or both
with ``--bucket-cap-mb``), in both orders of compiling and wrapping (``docs/compile.md``):

- ``gradsync, compile(ddp)`` / ``torch DDP, compile(ddp)``: ``torch.compile(Wrapper(model))``;
- ``gradsync, ddp(compile)`` / ``torch DDP, ddp(compile)``: ``Wrapper(torch.compile(model))``.

All four live in the same processes: each is compiled first (its graph breaks, graphs and
DDPOptimizer pieces counted while it compiles), then the timed rounds interleave them. Per
variant: the median step time of the slowest rank over every timed step, and its ratio to torch
DDP compiled in the same order.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import types
from datetime import timedelta
from typing import Any

from gradsync.bench import launch

WRAPPERS = ("gradsync", "torch DDP")
ORDERS = ("compile(ddp)", "ddp(compile)")
VARIANTS = tuple(f"{w}, {o}" for o in ORDERS for w in WRAPPERS)


def _build(variant: str, cfg: Any, backend: str, cap_mb: float | None) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradsync
    from gradsync.testing.gpt import GPT

    # Each variant's GPT gets a forward of its own (a copy of the code object): dynamo caches
    # compiled code per code object and guards on nothing of the wrapper's, so a second variant
    # would otherwise reuse the first one's graph, split for the first wrapper's buckets.
    forward = types.FunctionType(GPT.forward.__code__.replace(), GPT.forward.__globals__)
    torch.manual_seed(0)
    module = type("GPT", (GPT,), {"forward": forward})(cfg)
    wrap = gradsync.DistributedDataParallel if variant.startswith("gradsync") else TorchDDP
    caps = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    if variant.endswith("ddp(compile)"):
        model: Any = wrap(torch.compile(module, backend=backend), **caps)
    else:
        model = torch.compile(wrap(module, **caps), backend=backend)
    return model, torch.optim.AdamW(module.parameters(), lr=1e-3)


def _compile(variant: str, cfg: Any, args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """Build ``variant`` and run its first steps (the compilation); what dynamo counted, from
    a reset dynamo (the variants compiled before recompile on their next step)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from gradsync.testing.dynamo import ddp_optimizer_pieces

    dynamo.reset()
    counters.clear()
    with ddp_optimizer_pieces() as pieces:
        model, opt = _build(variant, cfg, args.backend, args.bucket_cap_mb)
        shape = (args.batch, cfg.block_size)
        launch.slowest_step_times(model, opt, shape, cfg.vocab_size, args.warmup, 0, seed=0)
    counted = {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "pieces": sum(pieces),
    }
    return model, opt, counted


def worker(args: argparse.Namespace) -> None:
    import torch._dynamo
    import torch.distributed as dist

    from gradsync.testing.gpt import GPTConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    if args.no_ddp_optimizer:  # one graph: every gradient appears at the end of the backward
        torch._dynamo.config.optimize_ddp = False
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    built = {v: _compile(v, cfg, args) for v in VARIANTS}
    shape = (args.batch, cfg.block_size)
    for model, opt, _ in built.values():  # recompile after the resets (cache hits)
        launch.slowest_step_times(model, opt, shape, cfg.vocab_size, args.warmup, 0, seed=0)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            model, opt, _ = built[v]
            times[v] += launch.slowest_step_times(
                model, opt, shape, cfg.vocab_size, 1, args.steps, seed=1000 * r + rank
            )
    if rank == 0:
        model = built[VARIANTS[0]][0]
        row: dict[str, Any] = {"world": world, "backend": args.backend}
        row["cap"], row["ddp_optimizer"] = args.bucket_cap_mb, not args.no_ddp_optimizer
        row["params"] = sum(p.numel() for p in model.parameters())
        row["compiled"] = {v: built[v][2] for v in VARIANTS}
        row["median_s"] = {v: statistics.median(t) for v, t in times.items()}
        row["n"] = len(times[VARIANTS[0]])
        print("COMPILE_JSON " + json.dumps(row), flush=True)
    # Drop the wrappers while the group is still registered. Otherwise torch DDP's C++ reducer,
    # freed when this frame ends, may hold the group's last reference: its destructor then joins
    # gloo's threads with the GIL held while one of them needs the GIL to free a finished
    # all-reduce's tensors (a deadlock seen here about one run in three).
    built.clear()
    del model, opt
    torch._dynamo.reset()  # its caches may refer to the wrappers too
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def report(row: dict[str, Any], where: str) -> str:
    lines = [
        f"{where}: {row['world']} ranks, GPT {row['params'] / 1e6:.1f}M parameters, AdamW fp32, "
        f"torch.compile backend={row['backend']}, "
        + (
            "each wrapper's default buckets"
            if row["cap"] is None
            else f"{row['cap']:g} MiB buckets"
        )
        + ("" if row["ddp_optimizer"] else ", optimize_ddp=False")
        + f", median of {row['n']} steps per variant (slowest rank)",
        "",
        "| variant | step (ms) | vs torch DDP, same order | graph breaks | graphs "
        "| DDPOptimizer pieces |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        t = row["median_s"][v]
        base = row["median_s"]["torch DDP, " + v.split(", ", 1)[1]]
        c = row["compiled"][v]
        lines.append(
            f"| {v} | {t * 1e3:.1f} | {t / base:.3f}x | {c['breaks']} | {c['graphs']} "
            f"| {c['pieces']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    launch.add_arguments(p, rounds=4, steps=5, warmup=3, timeout_s=2400.0)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--bucket-cap-mb", type=float, help="both wrappers (default: each its own)")
    p.add_argument("--no-ddp-optimizer", action="store_true", help="optimize_ddp=False: no overlap")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    # launch.run_workers's argv, plus --backend
    argv = [__file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps)]
    argv += ["--warmup", str(args.warmup), "--batch", str(args.batch), "--backend", args.backend]
    argv += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    argv += [] if args.bucket_cap_mb is None else ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    argv += ["--no-ddp-optimizer"] if args.no_ddp_optimizer else []
    if args.cluster:
        out = launch.on_cluster(argv, args.world, args.rate_mbit, args.timeout)
        where = f"simulated cluster, {args.rate_mbit:g} Mbit/s between {args.world} nodes"
    else:
        out, where = launch.on_loopback(argv, args.world, args.timeout), "loopback"
    print(report(launch.json_line(out, "COMPILE_JSON"), where))


if __name__ == "__main__":
    main()
