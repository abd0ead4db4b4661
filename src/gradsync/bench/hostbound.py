"""``gradsync bench --where host``: a step that is nearly all host work, at 1, 2 and 4 ranks.

    gradsync bench --where host                          # 1, 2 and 4 loopback ranks
    gradsync bench --where host --worlds 2 --rounds 60   # one world size, longer

On a GPU a small or fast model's step is bound by its host: the device waits while Python
queues kernels, runs autograd's hooks and launches the buckets, so what each library does per
parameter and per bucket on the host is the step. The same regime shows on a CPU when the
compute is tiny beside that work. The model here is a stack of ``--host-layers`` (150)
``nn.Linear(--host-width, --host-width)`` layers (8 wide: 300 parameter tensors, 10,800
parameters, 43 KB of gradients, one bucket for either library) on ``--batch-per-rank`` rows, so
its forward, backward and optimizer step are a few hundred tiny operators each: a proxy for a
GPU waiting on its host, without a GPU.

Four variants of the same model, each its own replica, run side by side on every rank and are
timed in the same rounds (:func:`gradsync.bench.steptime.time_interleaved`: one call per variant
per round, in an order shuffled every round, from a barrier to the slowest rank's end): torch's
``DistributedDataParallel`` at its defaults, gradsync at its defaults (the step timeline on,
``straggler_every=10``), gradsync with the timeline off (``straggler_every=0``) and the module
alone (no synchronisation: the compute and the optimizer, the floor of every step). A call takes
``--steps-per-round`` (10) steps back to back, so that one reading spans milliseconds, not one
step's few. World size 1 runs on a gloo group too: every library then does all its host work
per step and an all-reduce that has nobody to wait for.

The report (:mod:`gradsync.bench.host_report`) prints per world size each variant's median step,
gradsync's default over torch DDP's and the timeline's cost (gradsync default over timeline
off), both round by round, against the targets: at most 1.00x torch DDP, at most 1.01x for the
timeline. ``benchmarks/host_time.py`` splits the same model's host time by phase.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from gradsync.bench.replay import comm_plan
from gradsync.bench.steptime import DEFAULT_NAME, time_interleaved, wrap
from gradsync.bench.variant import DEFAULT_CAP, Variant
from gradsync.bench.worker import Progress, run_facts, untimed_steps, wrapper_defaults

TORCH_NAME = "torch DDP default"
TIMELINE_OFF_NAME = "gradsync timeline off (straggler_every=0)"
LOCAL_NAME = "compute only (local)"

HOST_VARIANTS = (
    Variant(TORCH_NAME, "torch_ddp", DEFAULT_CAP),
    Variant(DEFAULT_NAME, "gradsync", DEFAULT_CAP),
    Variant(TIMELINE_OFF_NAME, "gradsync", DEFAULT_CAP, straggler_every=0),
    Variant(LOCAL_NAME, "local"),
)
WORLDS = (1, 2, 4)
ROUNDS = 40
"""Timed rounds when ``--rounds`` is not given: a few seconds per world size on 2 vCPUs, and
enough for medians that move by well under the timeline's 1 % target between runs."""


@dataclass
class HostBoundConfig:
    num_layers: int = 150
    """``nn.Linear(width, width)`` layers, two parameter tensors each."""
    width: int = 8
    batch_per_rank: int = 4
    """Rows of ``width`` inputs per rank per step."""
    steps_per_round: int = 10
    """Steps each variant takes back to back in one timed call."""
    warmup: int = 1
    rounds: int = ROUNDS
    variants: tuple[Variant, ...] = field(default=HOST_VARIANTS)
    progress: str | None = None
    """A file rank 0 appends a line to after each round (``gradsync bench``'s progress bar)."""


def host_model(cfg: HostBoundConfig) -> nn.Sequential:
    """``num_layers`` x ``nn.Linear(width, width)``, the same on every rank (seed 0).

    The weights are orthogonal, so activations and gradients keep their scale through the
    stack. torch's default (uniform) matrices shrink a gradient by about 0.58 a layer: after
    150 the first layers' gradients are float32 subnormals (about 1e-41), on which a CPU
    computes slowly (the step took a third longer on the 2-vCPU build machine): compute, not
    the host's bookkeeping this model is for."""
    torch.manual_seed(0)
    layers = [nn.Linear(cfg.width, cfg.width) for _ in range(cfg.num_layers)]
    for layer in layers:
        nn.init.orthogonal_(layer.weight)
    return nn.Sequential(*layers)


def host_batch(rank: int, cfg: HostBoundConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets, the same every step (seeded by rank)."""
    g = torch.Generator().manual_seed(rank)
    shape = (cfg.batch_per_rank, cfg.width)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def host_steps(
    rank: int, cfg: HostBoundConfig
) -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module]]:
    """One training step per variant (zero_grad, forward, MSE loss, backward, SGD step) and
    each variant's model as called, every variant on its own replica."""
    x, y = host_batch(rank, cfg)
    steps, models = {}, {}
    for v in cfg.variants:
        module = host_model(cfg)
        model, after_backward = wrap(v, module)
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        steps[v.name] = _step(model, opt, after_backward, x, y)
        models[v.name] = model
    return steps, models


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    after_backward: Callable[[], None],
    x: torch.Tensor,
    y: torch.Tensor,
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        after_backward()
        opt.step()

    return step


def _repeat(step: Callable[[], None], times: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(times):
            step()

    return run


def host_rank(rank: int, world: int, cfg: HostBoundConfig) -> dict[str, Any] | None:
    """Rank body (:func:`gradsync.testing.spawn.spawn`, or any initialised group): every
    variant's seconds per step, round by round; rank 0 returns the results, others ``None``."""
    steps, models = host_steps(rank, cfg)
    untimed_steps(steps, models)  # torch DDP rebuilds its buckets in gradient-ready order
    progress = Progress(cfg.progress if rank == 0 else None, cfg.warmup + cfg.rounds)
    k = cfg.steps_per_round
    times = time_interleaved(
        {name: _repeat(step, k) for name, step in steps.items()},
        warmup=cfg.warmup,
        rounds=cfg.rounds,
        on_round=lambda r, n: progress.advance(f"round {r}/{n} (first {cfg.warmup} warm-up)"),
    )
    if rank != 0:
        return None
    module = host_model(cfg)
    return {
        **run_facts(world),
        "num_tensors": len(list(module.parameters())),
        "num_parameters": sum(p.numel() for p in module.parameters()),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("variants", "progress")},
        "variants": [asdict(v) for v in cfg.variants],
        "gradsync_defaults": wrapper_defaults(),
        "all_reduces": {v.name: len(comm_plan(v, models[v.name])) for v in cfg.variants},
        "step_s": {name: [t / k for t in ts] for name, ts in times.items()},
    }


def config(args: argparse.Namespace, progress: str | None = None) -> HostBoundConfig:
    """The host-bound run that ``gradsync bench --where host``'s flags ask for."""
    return HostBoundConfig(
        num_layers=args.host_layers,
        width=args.host_width,
        batch_per_rank=args.batch_per_rank,
        steps_per_round=args.steps_per_round,
        warmup=args.warmup,
        rounds=ROUNDS if args.rounds is None else args.rounds,
        progress=progress,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gradsync bench --where host`` (``--rounds``, ``--warmup`` and
    ``--batch-per-rank`` are shared with the GPT's settings)."""
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=list(WORLDS),
        help="with --where host: world sizes, one run each (default 1 2 4)",
    )
    parser.add_argument(
        "--host-layers",
        type=int,
        default=150,
        help="with --where host: Linear(w, w) layers of the model (default 150: 300 tensors)",
    )
    parser.add_argument(
        "--host-width", type=int, default=8, help="with --where host: w (default 8)"
    )
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=10,
        help="with --where host: steps each variant takes back to back per round (default 10)",
    )
