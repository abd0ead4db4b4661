"""The rank body of ``gradsync bench``: run by torchrun on every rank, writes JSON from rank 0.

    torchrun --standalone --nproc-per-node 2 -m gradsync.bench.worker --out results.json
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr HOST0 \\
        --master-port 29500 -m gradsync.bench.worker --out results.json          # R = 0, 1

It initialises from torchrun's environment, so the same module runs on loopback and across
(simulated or real) nodes. Two measurements, in this order:

1. Step time of every variant and, interleaved in the same rounds, the two quantities a step is
   made of: compute alone (the ``local`` variant, which synchronises nothing) and communication
   alone. Communication alone replays each variant's own all-reduces on idle buffers with the
   same sizes, in the same order and the same way (one blocking call per parameter for
   ``average_gradients``; all buckets launched asynchronously, then waited for, for the
   bucketed wrappers), plus one flat all-reduce of every gradient byte.
2. Bus bandwidth of single large all-reduces, for the ring bound (claims need >= 16 MB: a shaped
   link lets a burst of bytes through unthrottled, pitfall 4 in :mod:`gradsync.testing.cluster`).

Step times follow :func:`gradsync.bench.steptime.time_interleaved` and bus bandwidth
:func:`gradsync.testing.busbw.allreduce_times`: barrier first, slowest rank, medians.

This is a rank program that ``gradsync bench`` hands to torchrun (``-m gradsync.bench.worker``),
not a user entry point: users run ``gradsync bench`` (or ``python -m gradsync bench``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.bench import wire
from gradsync.bench.replay import COMM_PREFIX, FLAT, comm_plan, comm_tasks
from gradsync.bench.steptime import (
    DEFAULT_NAME,
    FORWARD_AND_STEP,
    StepTimeConfig,
    Variant,
    forward_and_step_task,
    make_step_tasks,
    num_parameters,
    time_interleaved,
)
from gradsync.bench.variant import DEFAULT_CAP
from gradsync.ddp import plan
from gradsync.ddp.plan import SCALED
from gradsync.testing.busbw import allreduce_times

MIB = 2**20
DEFAULT_CAPS: tuple[float, ...] = (0.0, 1.0, 5.0, 25.0, 100.0, math.inf)


def bench_variants(
    caps: Sequence[float] = DEFAULT_CAPS, formats: bool = False
) -> tuple[Variant, ...]:
    """The variants ``gradsync bench`` compares: naive, gradsync's default and each fixed
    bucket cap, "auto", torch DDP, local; with ``formats`` also the wire formats of
    :func:`gradsync.bench.wire.wire_variants`.

    ``math.inf`` is one bucket for the whole model (``bucket_cap_mb=math.inf``).
    """
    # The default depends on where the ranks are (torch's 25 MiB on one host, "scaled" across
    # hosts); "scaled" has its own row so that both show on both settings.
    variants = [
        Variant("average_gradients", "naive"),
        Variant(DEFAULT_NAME, "gradsync", DEFAULT_CAP),
        Variant("gradsync scaled", "gradsync", SCALED),
    ]
    for cap in caps:
        label = "one bucket" if cap == math.inf else f"cap {cap:g} MB"
        if cap == 0:
            label += " (per parameter)"
        variants.append(Variant(f"gradsync {label}", "gradsync", cap))
    variants.append(Variant("gradsync bucket_cap_mb='auto'", "gradsync_auto", None))
    variants.append(Variant("torch DDP default", "torch_ddp", DEFAULT_CAP))
    if formats:
        variants += wire.wire_variants()
    variants.append(Variant("compute only (local)", "local"))
    return tuple(variants)


def run_facts(world: int) -> dict[str, Any]:
    """Where a timed run ran, for its report: world size, torch, machine, threads, backend."""
    return {
        "world": world,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "omp_threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def wrapper_defaults() -> dict[str, Any]:
    """The gradsync wrapper's plain-valued defaults, which every gradsync variant runs with
    except ``bucket_cap_mb``: recorded so a report says what "default" meant on that day."""
    sig = inspect.signature(gradsync.DistributedDataParallel.__init__)
    return {
        name: p.default
        for name, p in sig.parameters.items()
        if isinstance(p.default, (bool, int, float, str, type(None)))
        and p.default is not inspect.Parameter.empty
    }


def time_allreduce(
    sizes_bytes: Sequence[int], iters: int, warmup: int, on_size: Callable[[], None]
) -> list[dict[str, Any]]:
    """Times of one float32 all-reduce per size (:func:`gradsync.testing.busbw.allreduce_times`:
    barrier first, slowest rank)."""
    rows = []
    for nbytes in sizes_bytes:
        times = allreduce_times(nbytes // 4, iters, warmup)
        rows.append({"size_bytes": nbytes // 4 * 4, "times_s": times})
        on_size()
    return rows


def step_config(args: argparse.Namespace) -> StepTimeConfig:
    """The model, batch, rounds and variants that the flags of :func:`add_model_arguments` set."""
    return StepTimeConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        batch_per_rank=args.batch_per_rank,
        warmup=args.warmup,
        rounds=args.rounds,
        variants=bench_variants([parse_cap(c) for c in args.caps], args.formats),
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank: measure; rank 0 returns the results (others ``None``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = step_config(args)
    total = 1 + cfg.warmup + cfg.rounds + len(args.busbw_sizes_mib)
    progress = Progress(args.progress if rank == 0 else None, total)

    steps, models = make_step_tasks(rank, cfg)
    # Three untimed steps of every variant: torch DDP rebuilds its buckets in gradient-ready
    # order (used from step 3), and the communication replay copies the rebuilt layout.
    counted = untimed_steps(steps, models)
    progress.advance("built models, 3 untimed steps")
    dtype = next(models[cfg.variants[0].name].parameters()).dtype
    plans = {v.name: comm_plan(v, models[v.name]) for v in cfg.variants if v.kind != "local"}
    local = next(v.name for v in cfg.variants if v.kind == "local")
    tasks = {**steps, FORWARD_AND_STEP: forward_and_step_task(rank, cfg, models[local])}
    grad_numel = sum(p.numel() for p in models[local].parameters())
    plans[FLAT] = [grad_numel]
    tasks.update(comm_tasks(cfg.variants, plans, dtype))

    times = time_interleaved(
        tasks,
        warmup=cfg.warmup,
        rounds=cfg.rounds,
        on_round=lambda r, n: progress.advance(f"round {r}/{n} (first {cfg.warmup} warm-up)"),
    )
    busbw = time_allreduce(
        [int(s * MIB) for s in args.busbw_sizes_mib],
        args.busbw_iters,
        args.busbw_warmup,
        lambda: progress.advance("bus bandwidth"),
    )
    if rank != 0:
        return None
    elem = torch.empty((), dtype=dtype).element_size()
    return {
        **run_facts(world),
        "dtype": str(dtype).removeprefix("torch."),
        "num_parameters": num_parameters(cfg),
        "grad_bytes": grad_numel * elem,
        "config": {k: v for k, v in asdict(cfg).items() if k != "variants"},
        "variants": [asdict(v) for v in cfg.variants],
        "gradsync_defaults": wrapper_defaults(),
        "step_s": {k: v for k, v in times.items() if not k.startswith(COMM_PREFIX)},
        "comm_s": {
            k.removeprefix(COMM_PREFIX): v for k, v in times.items() if k.startswith(COMM_PREFIX)
        },
        "comm_bytes": {k: [n * elem for n in v] for k, v in plans.items() if v},
        "step_bytes": wire.step_bytes(cfg.variants, models, plans, counted, world),
        "busbw": busbw,
        "auto_plan": auto_plan(cfg.variants, models),
        "default_plan": _default_plan(models[DEFAULT_NAME]),
    }


def auto_plan(variants: Sequence[Variant], models: dict[str, nn.Module]) -> str | None:
    """What ``bucket_cap_mb="auto"`` chose in this run and whether its trial kept it, in words
    (``None``: no auto row, or it had not switched yet)."""
    auto = [models[v.name] for v in variants if v.kind == "gradsync_auto"]
    model = auto[0] if auto else None
    tuner = model.bucket_tuner if isinstance(model, gradsync.DistributedDataParallel) else None
    if tuner is None or tuner.chosen is None:
        return None
    words = f"auto chose {_caps(tuner.chosen)}"
    if tuner.trial is not None:
        initial_s, chosen_s = tuner.trial
        kept = "kept it" if tuner.plan is tuner.chosen else f"went back to {_caps(tuner.plan)}"
        words += f"; {chosen_s * 1e3:.0f} against {initial_s * 1e3:.0f} ms a step on trial: {kept}"
    return words


def _default_plan(model: nn.Module) -> str:
    assert isinstance(model, gradsync.DistributedDataParallel)
    return f"cap {model.bucket_cap_mb:.3g} MB: {len(model.bucket_specs)} buckets"


def _caps(plan: Any) -> str:
    cap = "one bucket" if plan.cap_mb is None else f"cap {plan.cap_mb:.3g} MB"
    first = "" if plan.first_cap_mb is None else f", first bucket {plan.first_cap_mb:g} MB"
    return f"{cap}{first}: {plan.num_buckets} buckets"


def untimed_steps(
    steps: dict[str, Callable[[], None]], models: dict[str, nn.Module]
) -> dict[str, int]:
    """Three untimed steps of every variant, after "auto" has run alone until its plan is final
    (profile, switch, trial: the same step on every rank; alone, because its trial compares
    step times from forward to forward, which interleaved variants would fill); returns the
    bytes that gradsync's wire hooks counted in the third (a steady step: PowerSGD compresses
    from step 3 on)."""
    for name, model in models.items():
        tuner = getattr(model, "bucket_tuner", None)
        while tuner is not None and not tuner.settled:
            steps[name]()
    counted = {}
    for i in range(3):
        for name, step in steps.items():
            before = wire.counted_bytes(models[name])
            step()
            after = wire.counted_bytes(models[name])
            if i == 2 and before is not None and after is not None:
                counted[name] = after - before
    return counted


def spawn_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank body for :func:`gradsync.testing.spawn.spawn` (loopback): torchrun's measurement."""
    return run(args)


class Progress:
    """Rank 0 appends one line per finished phase to a file the driver follows.

    A file rather than stdout: the simulated cluster collects a node's output only when it
    exits, and the namespaces share the file system.
    """

    def __init__(self, path: str | None, total: int) -> None:
        self.path = path
        self.total = total
        self.done = 0
        if path:
            with open(path, "w"):
                pass

    def advance(self, what: str) -> None:
        self.done += 1
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{self.done} {self.total} {what}\n")


def parse_cap(text: str) -> float:
    """A fixed bucket cap in MiB from the command line; ``none`` (or ``one``, ``inf``) means
    one bucket (``math.inf``). The default ("scaled") and "auto" run in every bench."""
    if text.lower() in ("one", "inf"):
        return math.inf
    cap = plan.parse_cap(text)
    if isinstance(cap, str):
        raise argparse.ArgumentTypeError(f"--caps takes fixed caps ({cap!r} always runs)")
    return cap


def _checked_cap(text: str) -> str:
    """``--caps``' type: ``text`` as written, once :func:`parse_cap` accepts it (the ranks
    parse it again: the flags travel to them as text)."""
    parse_cap(text)
    return text


def add_model_arguments(p: argparse.ArgumentParser, rounds: int | None = 5) -> None:
    """Flags shared with the ``gradsync bench`` driver, which forwards them here (its
    ``--rounds`` defaults to ``None``: 5 for the GPT, more with ``--where host``)."""
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--batch-per-rank",
        type=int,
        default=4,
        help="sequences per rank per step (--where host: rows)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds after 3 untimed steps")
    p.add_argument(
        "--rounds",
        type=int,
        default=rounds,
        help="timed rounds (one step per variant; default 5, or with --where host 40 rounds of "
        "--steps-per-round steps)",
    )
    p.add_argument(
        "--caps",
        nargs="+",
        type=_checked_cap,
        default=["none" if c == math.inf else f"{c:g}" for c in DEFAULT_CAPS],
        help="gradsync bucket caps in MiB ('none': one bucket)",
    )
    p.add_argument(
        "--formats",
        action="store_true",
        help="also time the wire formats: gradsync bf16 and PowerSGD rank 4, torch DDP with\n"
        "bf16_compress_hook and powerSGD_hook (adds 4 variants to every round)",
    )
    p.add_argument("--busbw-sizes-mib", type=float, nargs="+", default=[16.0, 64.0])
    p.add_argument("--busbw-iters", type=int, default=5)
    p.add_argument("--busbw-warmup", type=int, default=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--progress", default=None, help="file rank 0 appends progress lines to")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    add_model_arguments(p)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run me under torchrun (RANK, WORLD_SIZE, MASTER_ADDR are missing)")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    if result is not None:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)  # the driver never reads half a file
        print(f"gradsync.bench.worker: wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    # The rank program torchrun starts for `gradsync bench`, not a command of its own.
    sys.exit(main())
