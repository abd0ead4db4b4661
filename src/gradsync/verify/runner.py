"""Run the 1-process reference and the N-rank run step by step, and collect the evidence.

The reference runs first, in this process, on the global batch ``batch_fn(0, 1, step)``, and
records its parameters, gradients and batch fingerprints per step. Then one spawn of N gloo ranks
trains the same model with gradsync on the ranks' shards; every rank compares itself with the
reference as it goes and sends back only numbers and fingerprints, so nothing model-sized
crosses back. Memory: each rank holds the reference's trajectory, ``(2 * steps + 1)`` copies of
the parameters in float64, which is why verify is meant for a small version of a model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradsync.ddp.naive import average_gradients
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.testing.gpt import lm_loss
from gradsync.testing.spawn import spawn
from gradsync.verify import inject as inj
from gradsync.verify.diagnose import (
    Diagnosis,
    Evidence,
    StepRecord,
    diagnose,
    first_divergence,
)

ModelFn = Callable[[], nn.Module]
BatchFn = inj.BatchFn
LossFn = Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]

OPTIMIZERS = ("sgd", "adamw")
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}


@dataclass
class VerifyConfig:
    """What to verify. Factories are ``"module:function"`` strings or module-level callables
    (the spawned ranks import them by name)."""

    model: str | ModelFn = "gradsync.verify.builtin:make_model"
    """``() -> nn.Module``. The runner calls ``torch.manual_seed(seed + rank)`` first (the
    reference gets ``seed``): ranks start from different weights, as an unseeded job does, and
    only the wrapper's broadcast makes them equal."""
    batches: str | BatchFn = "gradsync.verify.builtin:make_batch"
    """``(rank, world_size, step) -> tuple[Tensor, ...]``: rank ``rank``'s shard of global step
    ``step``, every tensor with the sample dimension first; ``(0, 1, step)`` is the whole global
    batch, and the ranks' shards of a step together hold exactly its samples."""
    loss: str | LossFn | None = None
    """``(model, batch) -> loss``, reduced as ``reduction`` says. Default: cross-entropy of
    ``model(*batch[:-1])`` against ``batch[-1]`` (class dimension last; -1 targets ignored)."""
    world_size: int = 2
    steps: int = 6
    steps_per_epoch: int | None = None
    """Steps in one epoch of the batch factory (default: its ``steps_per_epoch`` attribute, if
    any). Enables the epoch-order check and ``inject="no-set-epoch"``."""
    optimizer: str = "sgd"
    """"sgd" (plain: the update is ``lr * grad``, so any gradient error shows in the weights) or
    "adamw" (divides by the gradient's scale: a sum-vs-mean bug hardly moves its weights)."""
    lr: float | None = None
    """Default: 0.1 for sgd, 1e-3 for adamw."""
    reduction: str = "mean"
    bucket_cap_mb: float | None = 25.0
    tolerance: float = 1e-4
    """Largest difference allowed in loss, gradients and parameters at any step: absolute for
    values below 1, relative to the reference's largest value above. fp32 rounding across ranks
    gives differences of ~1e-7 per step on the built-in model (SGD: 3e-8 in weights, 1e-7 in
    gradients; AdamW, which amplifies the rounding of near-zero gradients: 7e-7 in weights), and
    runs are a few steps long, so 1e-4 is over 100x headroom. Each injected bug moves the
    gradients by more than 1e-2 at its first wrong step."""
    seed: int = 0
    inject: str | None = None
    """Reproduce a bug in the N-rank run only: a key of ``gradsync.verify.inject.INJECTIONS``."""
    timeout_s: float = 120.0
    """Seconds the N-rank run may take before its ranks are killed."""


@dataclass
class VerifyReport:
    """The outcome: per-step records and fingerprints (``evidence``) and likely causes."""

    config: VerifyConfig
    evidence: Evidence
    diagnoses: list[Diagnosis]
    divergence_step: int | None
    """The first step past the tolerance, ``None`` if there is none."""
    model_description: str = ""
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.divergence_step is None and not self.diagnoses


@dataclass
class _Reference:
    params: list[torch.Tensor]
    """Flat parameters before step 0, then after each step (``steps + 1`` entries)."""
    grads: list[torch.Tensor]
    losses: list[float]
    samples: list[list[str]]
    init_checksum: str


@dataclass
class _RankResult:
    init_checksum: str
    losses: list[float] = field(default_factory=list)
    param_diffs: list[float] = field(default_factory=list)
    grad_diffs: list[float] = field(default_factory=list)
    grad_ratios: list[float] = field(default_factory=list)
    update_ratios: list[float] = field(default_factory=list)
    samples: list[list[str]] = field(default_factory=list)


def resolve(spec: str | Callable[..., Any], what: str) -> Callable[..., Any]:
    """``"package.module:function"`` (or ``module:obj.attr``) to the callable it names."""
    if callable(spec):
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must look like 'module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is not callable")
    return obj


def default_loss(model: nn.Module, batch: Sequence[torch.Tensor], reduction: str) -> torch.Tensor:
    """Cross-entropy of ``model(*batch[:-1])`` against ``batch[-1]`` (the GPT's ``lm_loss``)."""
    return lm_loss(model(*batch[:-1]), batch[-1], reduction=reduction)


def _factories(cfg: VerifyConfig) -> tuple[ModelFn, BatchFn, LossFn]:
    model_fn = resolve(cfg.model, "model factory")
    batch_fn = resolve(cfg.batches, "batch factory")
    if cfg.loss is None:
        loss_fn: LossFn = functools.partial(default_loss, reduction=cfg.reduction)
    else:
        loss_fn = resolve(cfg.loss, "loss function")
    return model_fn, batch_fn, loss_fn


def epoch_length(cfg: VerifyConfig) -> int | None:
    """The configured steps per epoch, else the batch factory's ``steps_per_epoch`` attribute."""
    if cfg.steps_per_epoch is not None:
        return cfg.steps_per_epoch
    value = getattr(resolve(cfg.batches, "batch factory"), "steps_per_epoch", None)
    return value if isinstance(value, int) else None


def check_config(cfg: VerifyConfig) -> None:
    """Raise ``ValueError`` for settings that cannot run."""
    if cfg.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {cfg.world_size}")
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    if cfg.steps_per_epoch is not None and cfg.steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {cfg.steps_per_epoch}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
    if cfg.reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {cfg.reduction!r}")
    _, batch_fn, _ = _factories(cfg)  # fails here, not in every rank, on a bad "module:function"
    # One shard up front: a factory that rejects this world size says so before any spawn.
    _as_batch(batch_fn(0, cfg.world_size, 0), f"batch_fn(0, {cfg.world_size}, 0)")
    inj.check_injection(cfg.inject, cfg.world_size, cfg.reduction, cfg.steps, epoch_length(cfg))


def _optimizer(cfg: VerifyConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr)


def _as_batch(batch: Any, where: str) -> tuple[torch.Tensor, ...]:
    if not isinstance(batch, (tuple, list)) or not batch:
        raise ValueError(f"{where}: the batch factory must return a non-empty tuple of tensors")
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch):
        raise ValueError(f"{where}: every batch element must be a tensor with a sample dimension")
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"{where}: batch tensors must share a non-zero first (sample) dimension")
    return tuple(batch)


def sample_fingerprints(batch: Sequence[torch.Tensor]) -> list[str]:
    """One digest per sample, over the bytes of its row in every tensor of the batch."""
    n = batch[0].shape[0]
    rows = [t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy() for t in batch]
    out = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=8)
        for r in rows:
            h.update(r[i].tobytes())
        out.append(h.hexdigest())
    return out


def _checksum(params: list[nn.Parameter]) -> str:
    """A digest of the exact bytes of every parameter: equal means bitwise-identical replicas."""
    h = hashlib.blake2b(digest_size=6)
    for p in params:
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _flat(params: list[nn.Parameter]) -> torch.Tensor:
    # float64: differences of 1e-7 must not drown in the rounding of the comparison itself.
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=torch.float64)
            if p.grad is None
            else p.grad.detach().reshape(-1).double()
            for p in params
        ]
    )


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    num, den = a.norm().item(), b.norm().item()
    if den == 0.0:
        return 1.0 if num == 0.0 else float("inf")
    return num / den


def run_reference(cfg: VerifyConfig) -> tuple[_Reference, str]:
    """Train in this process on the global batches; return the trajectory and a model summary."""
    model_fn, batch_fn, loss_fn = _factories(cfg)
    torch.manual_seed(cfg.seed)
    model = model_fn()
    params = list(model.parameters())
    summary = f"{type(model).__name__} ({sum(p.numel() for p in params):,} parameters)"
    ref = _Reference([_flat(params)], [], [], [], _checksum(params))
    opt = _optimizer(cfg, [p for p in params if p.requires_grad])
    for step in range(cfg.steps):
        batch = _as_batch(batch_fn(0, 1, step), f"batch_fn(0, 1, {step})")
        ref.samples.append(sample_fingerprints(batch))
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        ref.grads.append(_flat_grads(params))
        opt.step()
        ref.params.append(_flat(params))
        ref.losses.append(loss.item())
    return ref, summary


def _rank_main(rank: int, world_size: int, cfg: VerifyConfig, ref: _Reference) -> _RankResult:
    """One rank of the N-rank run: train with gradsync and compare with the reference each step."""
    model_fn, batch_fn, loss_fn = _factories(cfg)
    spe = epoch_length(cfg)
    torch.manual_seed(cfg.seed + rank)
    model = model_fn()
    wrapped: nn.Module = model
    if inj.uses_wrapper(cfg.inject):
        wrapped = DistributedDataParallel(
            model,
            bucket_cap_mb=cfg.bucket_cap_mb,
            reduction=inj.ddp_reduction(cfg.reduction, cfg.inject),
        )
    params = list(model.parameters())
    out = _RankResult(_checksum(params))
    opt = _optimizer(cfg, [p for p in params if p.requires_grad])
    before = _flat(params)
    for step in range(cfg.steps):
        where = f"batch_fn({rank}, {world_size}, {step})"
        batch = _as_batch(inj.rank_batch(batch_fn, rank, world_size, step, cfg.inject, spe), where)
        out.samples.append(sample_fingerprints(batch))
        opt.zero_grad()
        loss = loss_fn(wrapped, batch)
        loss.backward()
        if not inj.uses_wrapper(cfg.inject):
            average_gradients(model, reduction=cfg.reduction)
        grads = _flat_grads(params)
        opt.step()
        after = _flat(params)
        out.losses.append(loss.item())
        out.param_diffs.append((after - ref.params[step + 1]).abs().max().item())
        out.grad_diffs.append((grads - ref.grads[step]).abs().max().item())
        out.grad_ratios.append(_ratio(grads, ref.grads[step]))
        out.update_ratios.append(_ratio(after - before, ref.params[step + 1] - ref.params[step]))
        before = after
    return out


def verify(cfg: VerifyConfig) -> VerifyReport:
    """Is N-rank training with gradsync the same as 1-process training? Run both and compare.

    Raises ``ValueError`` for a bad configuration and :class:`gradsync.errors.SpawnError` when a
    rank fails (the message names the rank).
    """
    check_config(cfg)
    t0 = time.perf_counter()
    # One intra-op thread, as in the spawned ranks: the same kernels round the same way, and a
    # tiny model on a shared machine runs 10-100x slower with oversubscribed threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, summary = run_reference(cfg)
    finally:
        torch.set_num_threads(threads)
    ranks: list[_RankResult] = spawn(
        _rank_main, cfg.world_size, args=(cfg, ref), pg_timeout_s=30.0, timeout_s=cfg.timeout_s
    )
    # The global loss: a mean loss is the mean of equal-sized shards' means, a sum the sum.
    scale = 1.0 / cfg.world_size if cfg.reduction == "mean" else 1.0
    records = [
        StepRecord(
            step=s,
            ref_loss=ref.losses[s],
            loss=scale * sum(r.losses[s] for r in ranks),
            max_param_diff=max(r.param_diffs[s] for r in ranks),
            max_grad_diff=max(r.grad_diffs[s] for r in ranks),
            grad_ratio=ranks[0].grad_ratios[s],
            update_ratio=ranks[0].update_ratios[s],
            param_scale=ref.params[s + 1].abs().max().item(),
            grad_scale=ref.grads[s].abs().max().item(),
        )
        for s in range(cfg.steps)
    ]
    evidence = Evidence(
        world_size=cfg.world_size,
        records=records,
        ref_init_checksum=ref.init_checksum,
        rank_init_checksums=[r.init_checksum for r in ranks],
        ref_samples=ref.samples,
        rank_samples=[[r.samples[s] for r in ranks] for s in range(cfg.steps)],
        steps_per_epoch=epoch_length(cfg),
    )
    return VerifyReport(
        config=cfg,
        evidence=evidence,
        diagnoses=diagnose(evidence, cfg.tolerance),
        divergence_step=first_divergence(evidence, cfg.tolerance),
        model_description=summary,
        elapsed_s=time.perf_counter() - t0,
    )
