"""What every group of the GPU check shares: the check record, the run's context and time
budget, how a group starts its ranks, and the small GPT whose backward starts with a slow kernel.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync.errors import SpawnError
from gradsync.testing.gpt import GPT, GPTConfig
from gradsync.testing.spawn import spawn

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"
MET, MISSED = "met", "missed"  # a speed target: reported, never the exit status
FAILING = (FAIL, ERROR)


@dataclass
class Check:
    """One line of the report: what is compared, against what bound, and what was measured."""

    id: str
    """Stable name (``group.what``): the dry-mode test compares the list of these."""
    title: str
    compares: str
    """What is measured against what (torch DDP's figure is reported beside it where torch has
    the feature)."""
    bound: str
    """The bound or target, and why that bound."""
    target: bool = False
    """A speed target: a miss (``missed``) is reported, but does not fail the run; an error
    does."""
    status: str = "not run"
    reason: str = ""
    """Why it was skipped or failed, or what it means (one or two sentences)."""
    measured: dict[str, Any] = field(default_factory=dict)

    def finish(self, status: str, reason: str = "", **measured: Any) -> None:
        self.status, self.reason = status, reason
        self.measured.update(measured)


@dataclass
class Context:
    """The run: CPU dry mode or the GPU, how many GPUs, the time budget, where files go."""

    dry: bool
    out: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    num_gpus: int = 0
    name: str = "gpu-check"
    """The report's file stem (files the groups keep are named after it)."""

    @property
    def cuda(self) -> bool:
        return not self.dry and self.num_gpus > 0

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def needs(self, checks: dict[str, Check], ids: list[str], gpus: int) -> bool:
        """Mark ``ids`` skipped (and return False) unless this run has ``gpus`` GPUs."""
        if self.cuda and self.num_gpus >= gpus:
            return True
        why = "needs CUDA (dry mode runs on CPU)" if not self.cuda else (
            f"needs {gpus} GPUs, this machine has {self.num_gpus}: NCCL allows one rank per GPU"
        )  # fmt: skip
        for i in ids:
            checks[i].finish(SKIPPED, f"skipped: {why}")
        return False


def run_job(
    ctx: Context, fn: Any, world: int, args: tuple[Any, ...], *, backend: str, limit_s: float,
    env: dict[str, str] | None = None, pg_timeout_s: float = 60.0,
) -> list[Any]:  # fmt: skip
    """``spawn(fn, world, args)`` under at most ``limit_s`` (and what is left of the budget),
    with ``env`` set in the ranks' environment (fresh processes then). Raises ``SpawnError``."""
    limit = max(10.0, min(limit_s, ctx.left_s()))
    with _environment(env or {}):
        return spawn(
            fn, world, args, backend=backend, pg_timeout_s=pg_timeout_s, timeout_s=limit,
            fresh=bool(env) or backend != "gloo",
        )  # fmt: skip


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def job_error(exc: BaseException) -> str:
    """A failed job in one line plus the first rank's last traceback lines."""
    if isinstance(exc, SpawnError) and getattr(exc, "failures", None):
        first = exc.failures[0]
        tail = " | ".join(first.traceback.strip().splitlines()[-3:])
        return f"rank {first.rank}: {first.exc_type}: {first.message[:300]} [{tail[:400]}]"
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def device_of(cuda: bool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def exact_math(cuda: bool) -> None:
    """Deterministic kernels, no TF32, the math attention kernel: what lets a world of one be
    compared with one process bit for bit. Call before the rank's first CUDA kernel."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


# ---------------------------------------------------------------------------------------------
# The model of the correctness, sync and overlap checks

SLOW_CYCLES = 20_000_000
"""``torch.cuda._sleep`` cycles at the start of every backward: about 10 ms at 1.5-2 GHz."""


class SlowGrad(torch.autograd.Function):
    """The identity, whose backward first holds the stream for ``SLOW_CYCLES``: every gradient
    kernel of the step is queued behind it, while the host runs ahead and launches the buckets.
    A collective or a hook that does not wait for the stream the backward runs on then reads a
    bucket before its gradients are in it, and the step's gradient is wrong."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_cuda:
            torch.cuda._sleep(SLOW_CYCLES)
        return grad.clone()


class SlowGPT(nn.Module):
    """The main job's GPT (``gradsync.testing.gpt``) behind :class:`SlowGrad`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return SlowGrad.apply(self.gpt(idx))


SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
"""The correctness model: 110K parameters, 8 buckets at ``BUCKET_CAP_MB``."""
BUCKET_CAP_MB = 0.05
GLOBAL_BATCH = 8  # sequences per step, split over the ranks
PAD = -1  # lm_loss's ignore_index


def batch(
    step: int, rank: int, world: int, device: torch.device, padded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (the same global batch at any world
    size); with ``padded`` some targets are padding, a different number per row."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, SMALL.vocab_size, (GLOBAL_BATCH, SMALL.block_size), generator=g)
    y = torch.roll(x, -1, dims=1)
    if padded:
        for row in range(GLOBAL_BATCH):
            y[row, : 3 * (row % 4)] = PAD
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows].to(device), y[rows].to(device)


def relative_error(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor]
) -> float:
    """The largest parameter difference over the largest distance training moved the reference
    from ``init``: 0 is bit for bit; 1e-6 is a rounding of the updates."""
    num = max((got[n].double() - ref[n].double()).abs().max().item() for n in ref)
    den = max((ref[n].double() - init[n].double()).abs().max().item() for n in ref)
    return num / den if den > 0 else float("inf") if num > 0 else 0.0


def environment() -> dict[str, Any]:
    """The device, versions and host of this run (the report's header)."""
    info: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
    }  # fmt: skip
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info
