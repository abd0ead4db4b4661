"""``gradsync verify --tp T --cp C``: the built-in GPT on a (dp, cp, tp) device mesh, step by
step against one process on the same global batches.

Every rank trains the GPT with its tensor-parallel shards, its chunk of every sequence and its
rows of the batch (``gradsync.testing.mesh_run``), synchronised by gradsync over dp and cp. After
each step the full gradients and parameters (DTensors gathered over tp) are compared with the
single-process run's. The tensor-parallel plan is written for the built-in GPT, so these layouts
verify gradsync's mesh support, not a user's model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPT, lm_loss
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import spawn
from gradsync.verify import builtin
from gradsync.verify.runner import DEFAULT_LR


@dataclass
class MeshReport:
    layout: mesh_run.Layout
    steps: int
    optimizer: str
    lr: float
    reduction: str
    bucket_cap_mb: float | str | None
    tolerance: float
    rows: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    """(step, reference loss, mesh loss, max |dparam|, max |dgrad|) per step."""
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(max(r[3], r[4], abs(r[1] - r[2])) <= self.tolerance for r in self.rows)


def check_layout(world_size: int, cp: int, tp: int) -> mesh_run.Layout:
    """The layout for ``world_size`` ranks, or ``ValueError`` saying which size does not fit."""
    if world_size % (cp * tp):
        raise ValueError(f"--world-size {world_size} is not divisible by cp * tp = {cp * tp}")
    layout = mesh_run.Layout(dp=world_size // (cp * tp), cp=cp, tp=tp)
    n_head = builtin.make_model().cfg.n_head
    problems = [
        (
            builtin.GLOBAL_BATCH % layout.dp,
            f"dp = {layout.dp} does not divide the built-in "
            f"global batch of {builtin.GLOBAL_BATCH} sequences",
        ),
        (
            builtin.BLOCK_SIZE % cp,
            f"--cp {cp} does not divide the built-in sequence length {builtin.BLOCK_SIZE}",
        ),
        (n_head % tp, f"--tp {tp} does not divide the built-in GPT's {n_head} attention heads"),
    ]
    for bad, why in problems:
        if bad:
            raise ValueError(why)
    return layout


def _optimizer(name: str, lr: float, params: Any) -> torch.optim.Optimizer:
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    return cls(params, lr=lr)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _loss(model: torch.nn.Module, batch: mesh_run.Batch, reduction: str) -> torch.Tensor:
    return lm_loss(model(batch[0]), batch[1], reduction)


def _rank(rank: int, world: int, report: MeshReport, seed: int) -> list | None:
    mesh = report.layout.build_mesh()
    # Replicas start different, as an unseeded job does; the tp ranks of one replica must
    # agree (torch's parallelize_module shards from one tensor), so the seed follows dp x cp.
    index = mesh_run.data_parallel_index(mesh)
    cfg = builtin.make_model().cfg
    model = mesh_run.make_model(cfg, mesh, seed=seed + index, dtype=torch.float32)
    ddp = DistributedDataParallel(
        model,
        device_mesh=mesh_run.data_parallel_mesh(mesh),
        bucket_cap_mb=report.bucket_cap_mb,
        reduction=report.reduction,
    )
    opt = _optimizer(report.optimizer, report.lr, ddp.parameters())
    steps = []
    for step in range(report.steps):
        part = mesh_run.rank_part(builtin.make_batch(0, 1, step), mesh)
        opt.zero_grad()
        loss = _loss(ddp, part, report.reduction)
        loss.backward()
        grads = _full_grads(model)
        opt.step()
        total = loss.detach().clone()  # the global loss: a mean (or sum) over dp x cp ranks
        dist.all_reduce(total, group=ddp.process_group)
        if report.reduction == "mean":
            total /= dist.get_world_size(ddp.process_group)
        steps.append((float(total), grads, full_parameters(model)))
    return steps if rank == 0 else None


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Absolute below 1, relative to the reference's largest value above (as ``verify``)."""
    out = 0.0
    for name, w in want.items():
        scale = max(1.0, w.abs().max().item())
        out = max(out, (got[name] - w).abs().max().item() / scale)
    return out


def verify_mesh(report: MeshReport, seed: int = 0, timeout_s: float = 120.0) -> MeshReport:
    """Fill ``report.rows``: the mesh run against one process, step by step."""
    start = time.perf_counter()
    ranks = spawn(_rank, report.layout.world_size, (report, seed), timeout_s=timeout_s)
    torch.manual_seed(seed)
    model: GPT = builtin.make_model()
    opt = _optimizer(report.optimizer, report.lr, model.parameters())
    for step, (loss, grads, params) in enumerate(ranks[0]):
        opt.zero_grad()
        ref_loss = _loss(model, builtin.make_batch(0, 1, step), report.reduction)
        ref_loss.backward()
        ref_grads = _full_grads(model)
        opt.step()
        ref_params = {n: p.detach() for n, p in model.named_parameters()}
        report.rows.append(
            (
                step,
                ref_loss.item(),
                loss,
                _max_diff(params, ref_params),
                _max_diff(grads, ref_grads),
            )
        )
    report.elapsed_s = time.perf_counter() - start
    return report


def format_mesh_report(report: MeshReport) -> str:
    lay = report.layout
    lines = [
        f"gradsync verify: dp{lay.dp} x cp{lay.cp} x tp{lay.tp} = {lay.world_size} ranks vs 1 "
        f"process, built-in GPT, {report.steps} steps, {report.optimizer} lr {report.lr:g}, "
        f"reduction {report.reduction}, bucket_cap_mb {report.bucket_cap_mb}",
        "",
        f"{'step':>4}  {'ref loss':>10}  {'mesh loss':>10}  {'max|dparam|':>11}  "
        f"{'max|dgrad|':>10}",
    ]
    for step, ref, got, dparam, dgrad in report.rows:
        lines.append(f"{step:>4}  {ref:>10.6f}  {got:>10.6f}  {dparam:>11.2e}  {dgrad:>10.2e}")
    verdict = "PASS" if report.passed else "FAIL"
    lines += [
        "",
        f"{verdict}: the mesh run {'equals' if report.passed else 'differs from'} 1-process "
        f"training within {report.tolerance:g} ({report.elapsed_s:.1f} s)",
    ]
    return "\n".join(lines)


def default_lr(optimizer: str, lr: float | None) -> float:
    return DEFAULT_LR[optimizer] if lr is None else lr
