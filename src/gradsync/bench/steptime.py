"""Step time of data-parallel variants, interleaved in one run so they share the machine's noise.

Every rank holds one model replica per variant. Each round times one training step of every
variant, in an order shuffled every round, each step started by a barrier so that ranks begin
together; a step's time is the slowest rank's. Medians over rounds are robust to the shared
machine's noise, and ratios between variants measured in the same rounds are what mean
something.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.bench import wire
from gradsync.bench.variant import DEFAULT_CAP, Variant, torch_ddp_caps, wrapper_cap
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss

DEFAULT_NAME = "gradsync default"
"""The row of gradsync at its default bucket cap, in this harness and in ``gradsync bench``."""

DEFAULT_VARIANTS = (
    Variant("average_gradients", "naive"),
    Variant("gradsync bucket_cap_mb=0", "gradsync", 0.0),
    Variant(DEFAULT_NAME, "gradsync", DEFAULT_CAP),
    Variant("torch DDP default", "torch_ddp", DEFAULT_CAP),
)


@dataclass
class StepTimeConfig:
    n_layer: int = 6
    n_embd: int = 512
    n_head: int = 8
    vocab_size: int = 64
    block_size: int = 64
    batch_per_rank: int = 4
    """Sequences per rank per step."""
    warmup: int = 2
    rounds: int = 10
    device: str = "cpu"
    """"cpu", or "cuda" for rank r on GPU r (one rank per GPU, nccl)."""
    variants: tuple[Variant, ...] = field(default=DEFAULT_VARIANTS)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )


def _build(
    variant: Variant, cfg: StepTimeConfig
) -> tuple[nn.Module, nn.Module, Callable[[], None]]:
    """(model to call, underlying module, what to run after backward)."""
    torch.manual_seed(0)
    gpt = GPT(cfg.gpt_config()).to(_device(cfg))
    model, after_backward = wrap(variant, gpt)
    return model, gpt, after_backward


def wrap(variant: Variant, module: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """``module`` wrapped as ``variant`` synchronises it: (model to call, what to run after
    backward). Any model: the GPT of ``gradsync bench``, the host-bound stack of
    :mod:`gradsync.bench.hostbound`."""
    if variant.kind == "naive":
        return module, lambda: gradsync.average_gradients(module)
    if variant.kind == "gradsync":
        options: dict[str, Any] = {}
        if variant.straggler_every is not None:  # else the wrapper's own default
            options["straggler_every"] = variant.straggler_every
        ddp = gradsync.DistributedDataParallel(
            module,
            bucket_cap_mb=wrapper_cap(variant.bucket_cap_mb),
            first_bucket_cap_mb=variant.first_bucket_cap_mb,
            algorithm=variant.algorithm,
            **options,
        )
        return ddp, lambda: None
    if variant.kind == "gradsync_auto":  # profiles its first steps, then switches plan
        return gradsync.DistributedDataParallel(module, bucket_cap_mb="auto"), lambda: None
    if variant.kind == "torch_ddp":
        caps = torch_ddp_caps(variant.bucket_cap_mb)
        return torch.nn.parallel.DistributedDataParallel(module, **caps), lambda: None
    if variant.kind == "local":
        return module, lambda: None
    if variant.kind in ("gradsync_wire", "torch_ddp_hook"):
        return wire.build(variant, module), lambda: None
    raise ValueError(f"unknown variant kind {variant.kind!r}")


def _device(cfg: StepTimeConfig) -> torch.device:
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(cfg.device)


def rank_batch(rank: int, cfg: StepTimeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and targets, the same every call (seeded by rank)."""
    g = torch.Generator().manual_seed(rank)
    shape = (cfg.batch_per_rank, cfg.block_size)
    x = torch.randint(0, cfg.vocab_size, shape, generator=g).to(_device(cfg))
    y = torch.randint(0, cfg.vocab_size, shape, generator=g).to(_device(cfg))
    return x, y


def make_step_tasks(
    rank: int, cfg: StepTimeConfig
) -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module]]:
    """One training step per variant as a callable, and each variant's model as called.

    The models come back too because callers that time communication alone need the bucket
    layout each wrapper chose (``bucket_specs`` of gradsync's wrapper, the logging data of torch's).
    Every rank draws its own batch (seeded by rank), as data-parallel ranks do.
    """
    built = {v.name: _build(v, cfg) for v in cfg.variants}
    x, y = rank_batch(rank, cfg)

    def step_of(name: str) -> Callable[[], None]:
        model, module, after_backward = built[name]
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            after_backward()
            opt.step()

        return step

    tasks = {v.name: step_of(v.name) for v in cfg.variants}
    return tasks, {name: model for name, (model, _, _) in built.items()}


FORWARD_AND_STEP = "compute: forward and optimizer step"
"""A task timed with the local variant's replica: the part of a step that no communication of
its gradients can overlap (they do not exist before the backward, and the optimizer needs them
all), so that ``forward and step + max(backward, communication)`` bounds every variant's step
from below (:func:`gradsync.bench.report.step_limit`)."""


def forward_and_step_task(rank: int, cfg: StepTimeConfig, model: nn.Module) -> Callable[[], None]:
    """The forward (graph recorded and dropped, as a training forward records it) and an
    optimizer step on the ``.grad`` the local variant's last step left: ``model``'s step without
    its backward, on the batch of :func:`make_step_tasks`."""
    x, y = rank_batch(rank, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run() -> None:
        lm_loss(model(x), y)
        opt.step()

    return run


def round_order(names: list[str], r: int) -> list[str]:
    """The order of round ``r`` in :func:`time_interleaved`: ``names`` shuffled by a generator
    seeded with ``r``, the same on every rank."""
    order = list(names)
    random.Random(r).shuffle(order)
    return order


def time_interleaved(
    tasks: dict[str, Callable[[], None]],
    *,
    warmup: int,
    rounds: int,
    device: str = "cpu",
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Time every task once per round, in an order shuffled each round; collective.

    Every rank must pass the same task names in the same order; round ``r``'s order is drawn
    from a generator seeded with ``r``, so every rank draws the same one. Each call starts after
    a barrier and lasts as long as its slowest rank (a MAX all-reduce of the elapsed times), so
    a rank that starts early cannot shorten it. A new order each round spreads slow phases of
    the shared machine over all tasks, and changes which task runs just before which (a
    rotation would always put the same task before a given one, and a task can leave the
    caches, the allocator or the gloo threads in a state that favours or slows the next).
    ``times[name][i]`` of every task come from the same round ``i``, so ratios can be taken
    round by round (:func:`gradsync.bench.report.paired_ratio`). ``on_round(done, total)``
    runs after each round, warm-up rounds included (progress reporting); the first ``warmup``
    rounds are not recorded.
    """
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    names = list(tasks)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in round_order(names, r):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            tasks[name]()
            sync()  # GPU work is asynchronous: the step ends when the device is done
            elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64, device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # as long as its slowest rank
            if r >= warmup:
                times[name].append(elapsed.item())
        if on_round is not None:
            on_round(r + 1, warmup + rounds)
    return times


def run_rank(rank: int, world: int, cfg: StepTimeConfig) -> dict[str, list[float]]:
    """Rank body (for :func:`gradsync.testing.spawn.spawn` or torchrun): step times per variant."""
    tasks, _ = make_step_tasks(rank, cfg)
    return time_interleaved(tasks, warmup=cfg.warmup, rounds=cfg.rounds, device=cfg.device)


def summarize(times: dict[str, list[float]], baseline: str) -> list[tuple[str, float, float]]:
    """(variant, median seconds, ratio to the baseline's median) for every variant."""
    base = statistics.median(times[baseline])
    return [(name, statistics.median(t), statistics.median(t) / base) for name, t in times.items()]


def markdown_table(rows: list[tuple[str, float, float]], baseline: str) -> str:
    lines = [
        f"| variant | median step (ms) | ratio to {baseline} |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {med * 1e3:.1f} | {ratio:.3f} |" for name, med, ratio in rows]
    return "\n".join(lines)


def num_parameters(cfg: StepTimeConfig) -> int:
    gpt = GPT(cfg.gpt_config())
    return sum(p.numel() for p in gpt.parameters())
