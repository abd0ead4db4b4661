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
import importlib
import time
import traceback
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
from gradsync.verify import leaves
from gradsync.verify.diagnose import (
    Diagnosis,
    Evidence,
    StepRecord,
    diagnose,
    first_divergence,
)
from gradsync.verify.measure import checksum, flat, flat_grads, ratio, sample_fingerprints

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
    bucket_cap_mb: float | str | None = "scaled"
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
    deterministic: int | None = None
    """Leaves per step: verify the deterministic mode against its definition, bit for bit
    (``leaves.py``); ``None``: the default mode against one backward on the global batch."""


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


class FactoryError(ValueError):
    """A factory that cannot be loaded, fails, or returns the wrong kind of thing. ``field`` is
    the :class:`VerifyConfig` field that holds it, for a front end to name (``--model``)."""

    def __init__(self, field: str, spec: object, problem: str) -> None:
        self.field, self.spec, self.problem = field, spec, problem
        super().__init__(f"{field}={spec!r}: {problem}")


def resolve(spec: str | Callable[..., Any], field: str) -> Callable[..., Any]:
    """``"package.module:function"`` (or ``module:obj.attr``) to the callable it names."""
    if callable(spec):
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(field, spec, "must look like 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(field, spec, f"cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(field, spec, f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(field, spec, "is not callable")
    return obj


def _call(field: str, spec: object, fn: Callable[..., Any], *args: Any, shown: str) -> Any:
    """``fn(*args)``, shown as ``shown``: what it raises is the fault of the factory in ``field``,
    reported in one line with where it was raised (a traceback is for bugs of gradsync)."""
    try:
        return fn(*args)
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        at = "" if tb.filename == __file__ else f" (at {tb.filename}:{tb.lineno})"
        problem = f"failed in {shown}: {type(exc).__name__}: {exc}{at}"
        raise FactoryError(field, spec, problem) from exc


def default_loss(model: nn.Module, batch: Sequence[torch.Tensor], reduction: str) -> torch.Tensor:
    """Cross-entropy of ``model(*batch[:-1])`` against ``batch[-1]`` (the GPT's ``lm_loss``)."""
    return lm_loss(model(*batch[:-1]), batch[-1], reduction=reduction)


def _factories(cfg: VerifyConfig) -> tuple[ModelFn, BatchFn, LossFn]:
    model_fn = resolve(cfg.model, "model")
    batch_fn = resolve(cfg.batches, "batches")
    if cfg.loss is None:
        loss_fn: LossFn = functools.partial(default_loss, reduction=cfg.reduction)
    else:
        loss_fn = resolve(cfg.loss, "loss")
    return model_fn, batch_fn, loss_fn


def epoch_length(cfg: VerifyConfig) -> int | None:
    """The configured steps per epoch, else the batch factory's ``steps_per_epoch`` attribute."""
    if cfg.steps_per_epoch is not None:
        return cfg.steps_per_epoch
    value = getattr(resolve(cfg.batches, "batches"), "steps_per_epoch", None)
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
    where = f"batch_fn(0, {cfg.world_size}, 0)"
    batch = _call("batches", cfg.batches, batch_fn, 0, cfg.world_size, 0, shown=where)
    _as_batch(cfg, batch, where)
    inj.check_injection(cfg.inject, cfg.world_size, cfg.reduction, cfg.steps, epoch_length(cfg))
    if cfg.deterministic is not None:
        whole = _call("batches", cfg.batches, batch_fn, 0, 1, 0, shown="batch_fn(0, 1, 0)")
        samples = len(_as_batch(cfg, whole, "batch_fn(0, 1, 0)")[0])
        if cfg.inject is not None or not cfg.world_size <= cfg.deterministic <= samples:
            raise ValueError(
                f"deterministic={cfg.deterministic} leaves: need no inject, and at least "
                f"world_size={cfg.world_size} leaves and at most the global batch's {samples} "
                "samples"
            )


def _optimizer(cfg: VerifyConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr)


def _as_batch(cfg: VerifyConfig, batch: Any, where: str) -> tuple[torch.Tensor, ...]:
    fault = ""
    if not isinstance(batch, (tuple, list)) or not batch:
        fault = f"{type(batch).__name__}, not a non-empty tuple of tensors,"
    elif not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch):
        fault = "an element that is not a tensor with a sample dimension"
    elif len({t.shape[0] for t in batch}) != 1 or batch[0].shape[0] == 0:
        fault = "tensors without a common non-zero first (sample) dimension"
    if fault:
        raise FactoryError("batches", cfg.batches, f"returned {fault} in {where}")
    return tuple(batch)


def _backward(loss_fn: LossFn, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> float:
    loss = loss_fn(model, batch)
    loss.backward()  # under _call: a loss that is not a scalar tensor fails here, by name
    return float(loss.item())


def run_reference(cfg: VerifyConfig) -> tuple[_Reference, str]:
    """Train in this process on the global batches; return the trajectory and a model summary."""
    model_fn, batch_fn, loss_fn = _factories(cfg)
    torch.manual_seed(cfg.seed)
    model = _call("model", cfg.model, model_fn, shown="model_fn()")
    if not isinstance(model, nn.Module) or next(model.parameters(), None) is None:
        got = type(model).__name__ + (" without parameters" if isinstance(model, nn.Module) else "")
        raise FactoryError(
            "model", cfg.model, f"did not return a torch.nn.Module with parameters (got {got})"
        )
    params = list(model.parameters())
    summary = f"{type(model).__name__} ({sum(p.numel() for p in params):,} parameters)"
    ref = _Reference([flat(params)], [], [], [], checksum(params))
    opt = _optimizer(cfg, [p for p in params if p.requires_grad])
    for step in range(cfg.steps):
        where = f"batch_fn(0, 1, {step})"
        batch = _call("batches", cfg.batches, batch_fn, 0, 1, step, shown=where)
        batch = _as_batch(cfg, batch, where)
        ref.samples.append(sample_fingerprints(batch))
        opt.zero_grad()
        shown = f"loss_fn(model, {where})"
        if cfg.deterministic:
            leaf = leaves.reference_backward(
                model, loss_fn, batch, cfg.deterministic, cfg.reduction
            )
            ref.losses.append(leaf)
        else:
            ref.losses.append(
                _call("loss", cfg.loss, _backward, loss_fn, model, batch, shown=shown)
            )
        ref.grads.append(flat_grads(params))
        opt.step()
        ref.params.append(flat(params))
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
            deterministic=cfg.deterministic,
        )
    params = list(model.parameters())
    out = _RankResult(checksum(params))
    opt = _optimizer(cfg, [p for p in params if p.requires_grad])
    before = flat(params)
    for step in range(cfg.steps):
        if cfg.deterministic:  # every rank its leaves of the global batch
            where = f"batch_fn(0, 1, {step})"
            whole = _as_batch(cfg, batch_fn(0, 1, step), where)
            mine = leaves.rank_leaves(whole, cfg.deterministic, rank, world_size)
            out.samples.append([s for leaf in mine for s in sample_fingerprints(leaf)])
        else:
            where = f"batch_fn({rank}, {world_size}, {step})"
            batch = inj.rank_batch(batch_fn, rank, world_size, step, cfg.inject, spe)
            batch = _as_batch(cfg, batch, where)
            out.samples.append(sample_fingerprints(batch))
        opt.zero_grad()
        if cfg.deterministic:
            loss = torch.tensor(leaves.rank_backward(wrapped, loss_fn, mine))
        else:
            loss = loss_fn(wrapped, batch)
            loss.backward()
        if not inj.uses_wrapper(cfg.inject):
            average_gradients(model, reduction=cfg.reduction)
        grads = flat_grads(params)
        opt.step()
        after = flat(params)
        out.losses.append(loss.item())
        out.param_diffs.append((after - ref.params[step + 1]).abs().max().item())
        out.grad_diffs.append((grads - ref.grads[step]).abs().max().item())
        out.grad_ratios.append(ratio(grads, ref.grads[step]))
        out.update_ratios.append(ratio(after - before, ref.params[step + 1] - ref.params[step]))
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
    if cfg.deterministic:  # the ranks' sums of leaf losses: the step's mean over leaves
        scale = 1.0 / cfg.deterministic if cfg.reduction == "mean" else 1.0
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
