"""The communication paths the GPU check trains through, each as gradsync, as torch DDP with the
same feature (where torch has it), and as one process without a wrapper (the reference).

A :class:`Run` is one of them on one rank: built from a :class:`Mode`, it trains step after step
on its rows of the global batch (``common.batch``) and gives its parameters back. The same runs
serve the correctness group (their parameters), the sync group (their steps under the sync
debug mode) and the overlap group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.optim import MasterWeights
from gradsync.testing.gpt import GPTConfig, lm_loss

from .common import BUCKET_CAP_MB, PAD, SMALL, SlowGPT, batch

FP32 = 1e-4
"""fp32 runs whose sums are taken in another order (2 ranks each summing half the batch, then
each other's halves): rounding of ~1e-7 per operation, measured 2.8e-7 of the update on CPU
after 4 steps (torch DDP: the same); over 300x margin."""
LR, MOMENTUM, STEPS = 0.05, 0.9, 4


@dataclass(frozen=True)
class Mode:
    """One communication path: gradsync's settings, its loop, its torch DDP twin, its bounds."""

    name: str
    slug: str
    wrapper: dict[str, Any] = field(default_factory=dict)
    loop: str = "plain"
    """plain | item_mean (summed loss, counts given as CUDA tensors) | master (bf16 model,
    MasterWeights on fp32 main gradients) | zero (shard_optimizer)."""
    side: bool = False
    """Forward, backward and step under ``torch.cuda.stream(side)``."""
    hook: str | None = None
    """A torch comm hook registered on the wrapper: allreduce | powersgd | bf16 | fp16."""
    powersgd: bool = False
    """``compression=gradsync.comm.PowerSGD(2)``."""
    torch_twin: str | None = "plain"
    """torch DDP with the same feature (the same ``hook``, ZeroRedundancyOptimizer), or None."""
    bound_ref: float | None = 0.0
    """World size 1 against one process (0: bit for bit); None: no exact reference exists."""
    bound_g2: float = FP32
    why: str = (
        "a world of one sums nothing, so the same kernels give the same bits; 2 ranks add the "
        "halves of the batch in another order: fp32 rounding, 2.8e-7 on CPU"
    )
    gloo_refuses_cuda: bool = False
    """Documented: on gloo this path refuses CUDA tensors (docs/gpu.md, What runs where)."""
    timeline: bool = False
    """The step timeline on (the default, ``straggler_every=10``); off in the other modes, so
    that a fault of the timeline's CUDA events shows in the two modes that keep it, not in
    every mode."""


MODES = (
    Mode("default (NCCL all-reduce, step timeline on)", "default", timeline=True),
    Mode("bf16 wire", "bf16_wire", {"compression": "bf16"}, torch_twin="bf16", bound_g2=1e-2,
         why="bf16 rounds each gradient by 2^-9 on the wire (fp32 sums): 3.5e-3 of the update "
         "after 4 steps on CPU; nothing is rounded at world size 1", gloo_refuses_cuda=True),
    Mode("fp16 wire", "fp16_wire", {"compression": "fp16"}, torch_twin="fp16", bound_g2=2e-3,
         why="fp16 rounds each gradient by 2^-11 on the wire: 4.7e-4 of the update on CPU; "
         "nothing is rounded at world size 1", gloo_refuses_cuda=True),
    Mode("PowerSGD (rank 2)", "powersgd", powersgd=True, torch_twin="powersgd", bound_ref=None,
         bound_g2=1e-3, why="PowerSGD approximates even one rank's gradient: no exact "
         "reference; 2 ranks equal world size 1 up to rounding (P = sum(M_i) Q is linear): "
         "2.6e-7 on CPU, 1e-3 leaves room for the orthonormalisation"),
    Mode("torch comm hook (allreduce_hook)", "torch_hook", hook="allreduce",
         torch_twin="allreduce"),
    Mode("main_grad_dtype=float32 + MasterWeights (bf16 model)", "main_grads",
         {"main_grad_dtype": torch.float32}, loop="master", torch_twin=None, bound_g2=2e-2,
         why="2 ranks sum two bf16 half-batch gradients in fp32 where one process has one "
         "bf16 full-batch gradient: 2^-8 of each gradient, 3.9e-3 of the update on CPU; the "
         "fp32 master weights are compared"),
    Mode("ZeRO-1 (shard_optimizer, SGD)", "zero1", loop="zero", torch_twin="zero",
         gloo_refuses_cuda=True),
    Mode("check_finite=True", "check_finite", {"check_finite": True}, torch_twin=None),
    Mode("reduction=item_mean, CUDA counts", "item_mean", {"reduction": "item_mean"},
         loop="item_mean", torch_twin=None, bound_ref=FP32,
         why="one process divides inside the loss, gradsync after the sum: one rounding "
         "per element, 4.8e-7 on CPU"),
    Mode("side stream, default (step timeline on)", "side_default", side=True, timeline=True),
    Mode("side stream, PowerSGD", "side_powersgd", side=True, powersgd=True,
         torch_twin="powersgd", bound_ref=None, bound_g2=1e-3,
         why="as PowerSGD; compared with the serialised run bit for bit"),
    Mode("side stream, torch comm hook", "side_torch_hook", side=True, hook="allreduce",
         torch_twin="allreduce"),
)  # fmt: skip
BY_SLUG = {m.slug: m for m in MODES}


def _torch_hook(name: str) -> tuple[Any, Any]:
    """(state, hook) of torch's comm hook ``name``."""
    if name == "powersgd":
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=5
        )
        return state, psgd.powerSGD_hook
    hooks = {"allreduce": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
             "fp16": default_hooks.fp16_compress_hook}  # fmt: skip
    return None, hooks[name]


class Run:
    """``mode`` trained on ``rank``'s rows by ``impl`` ("gradsync", "torch" or "reference": one
    process on the whole batch), on ``device``."""

    def __init__(
        self, mode: Mode, impl: str, rank: int, world: int, device: torch.device,
        cfg: GPTConfig = SMALL, timeout_s: float = 30.0, extra: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.mode, self.impl, self.device = mode, impl, device
        self.rank, self.world = (0, 1) if impl == "reference" else (rank, world)
        torch.manual_seed(0)
        module = SlowGPT(cfg).to(device)
        if mode.loop == "master":
            module = module.to(torch.bfloat16)
        self.module = module
        self.model: Any = module
        self.side = torch.cuda.Stream(device) if mode.side and device.type == "cuda" else None
        if impl == "gradsync":
            kwargs = {"bucket_cap_mb": BUCKET_CAP_MB, "timeout": timeout_s, **mode.wrapper}
            if not mode.timeline:
                kwargs["straggler_every"] = 0
            if mode.powersgd:
                kwargs["compression"] = gradsync.comm.PowerSGD(2, seed=5)
            kwargs.update(extra or {})
            self.model = gradsync.DistributedDataParallel(module, **kwargs)
            if mode.hook:
                self.model.register_comm_hook(*_torch_hook(mode.hook))
        elif impl == "torch":
            assert mode.torch_twin is not None
            # torch's powerSGD_hook hangs on gloo once compression starts with several buckets
            # (seen with torch 2.13 on CPU): its twin gets one bucket, on every backend alike.
            cap = 1e4 if mode.torch_twin == "powersgd" else BUCKET_CAP_MB
            self.model = TorchDDP(module, bucket_cap_mb=cap)
            if mode.torch_twin not in ("plain", "zero"):
                self.model.register_comm_hook(*_torch_hook(mode.torch_twin))
        self.opt = self._optimizer()
        self.steps = 0
        self._batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefetch(self, steps: int) -> None:
        """Put the next ``steps`` batches on the device now: copying a batch from pageable
        host memory is itself a host sync, which the sync check must not count."""
        for step in range(self.steps, self.steps + steps):
            padded = self.mode.loop == "item_mean"
            self._batches[step] = batch(step, self.rank, self.world, self.device, padded)

    def _optimizer(self) -> Any:
        if self.mode.loop == "zero" and self.impl == "gradsync":
            return self.model.shard_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        if self.mode.loop == "zero" and self.impl == "torch":
            return ZeroRedundancyOptimizer(
                self.module.parameters(), optimizer_class=torch.optim.SGD, lr=LR,
                momentum=MOMENTUM,
            )  # fmt: skip
        if self.mode.loop == "master":
            params = self.module.parameters()
            return MasterWeights(params, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        return torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Under the mode's side stream, ordered after everything queued before."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def loss(self, step: int, poison: bool = False) -> torch.Tensor:
        """Forward of step ``step``'s batch (and the count, for item_mean); ``poison``: NaN."""
        item_mean = self.mode.loop == "item_mean"
        if step in self._batches:
            x, y = self._batches.pop(step)
        else:
            x, y = batch(step, self.rank, self.world, self.device, padded=item_mean)
        logits = self.model(x).float()
        if not item_mean:
            loss = lm_loss(logits, y)
        else:
            loss = lm_loss(logits, y, reduction="sum")
            if self.impl == "gradsync":
                self.model.count_items((y != PAD).sum())  # a CUDA tensor: no host read
            else:
                loss = loss / (y != PAD).sum()
        return loss * float("nan") if poison else loss

    def step(self) -> None:
        with self.stream():
            self.opt.zero_grad()
            self.loss(self.steps).backward()
            self.opt.step()
        self.steps += 1

    def train(self, steps: int = STEPS) -> dict[str, torch.Tensor]:
        for _ in range(steps):
            self.step()
        return self.params()

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters (fp32 master weights with MasterWeights), on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.mode.loop == "master":
            names = [n for n, p in self.module.named_parameters() if p.requires_grad]
            masters = zip(names, self.opt.master, strict=True)
            return {n: m.detach().cpu().clone() for n, m in masters}
        return {n: p.detach().float().cpu().clone() for n, p in self.module.named_parameters()}

    def nan_probe(self) -> str:
        """A step whose loss is NaN on rank 0 only: what every rank raised (check_finite)."""
        try:
            with self.stream():
                self.opt.zero_grad()
                self.loss(self.steps, poison=self.rank == 0).backward()
        except gradsync.GradsyncError as exc:
            return type(exc).__name__
        return "nothing raised"

    def close(self) -> None:
        """Drop the wrapper before the next run: its worker threads and private group go."""
        self.model = self.opt = self.module = None  # type: ignore[assignment]


def initial_params(device: torch.device, loop: str) -> dict[str, torch.Tensor]:
    """The parameters every run starts from (fp32 copies)."""
    return Run(BY_SLUG["main_grads" if loop == "master" else "default"], "reference", 0, 1,
               device).params()  # fmt: skip


def reference_of(mode: Mode) -> str:
    """Which one-process run ``mode`` is compared with: plain, item_mean or master."""
    return mode.loop if mode.loop in ("item_mean", "master") else "plain"
