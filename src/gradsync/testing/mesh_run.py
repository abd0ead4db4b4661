"""Training the demo GPT on a (dp, cp, tp) device mesh, and the one-process run it must equal.

Shared by the mesh tests, ``gradsync verify --tp/--cp`` and the 3-D main job, so all three
check the same computation. Every rank is given the *global* batch of each step and takes its
part: rows by its dp coordinate, a chunk of every sequence by its cp coordinate, all of it on
every tp rank (tensor parallelism splits the weights, not the data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.testing.gpt import GPT, GPTConfig, enable_context_parallel, lm_loss
from gradsync.testing.parallel import ContextParallel, apply_tensor_parallel

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), each (batch, time)


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh axes; their product is the world size."""

    dp: int
    """Data parallel: replicas fed different sequences."""
    cp: int = 1
    """Context parallel: ranks holding different chunks of the same sequences."""
    tp: int = 1
    """Tensor parallel: ranks holding different shards of the weights, fed the same data."""

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The (dp, cp, tp) mesh over all ranks, tp fastest-varying (neighbours share weights)."""
        return init_device_mesh(
            device_type, (self.dp, self.cp, self.tp), mesh_dim_names=("dp", "cp", "tp")
        )


def random_batches(
    cfg: GPTConfig, batch: int, steps: int, *, masked: bool = False, seed: int = 0
) -> list[Batch]:
    """``steps`` global batches of random tokens; ``masked`` ignores ~40% of the targets (-1),
    so every rank's part (and every context-parallel chunk) holds a different number of valid
    tokens: the case ``item_mean`` exists for."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        if masked:
            targets[torch.rand(targets.shape, generator=g) < 0.4] = -1
        out.append((tokens, targets))
    return out


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The axes gradients are summed over: dp and cp (see [Note: which mesh axes are summed])."""
    return mesh["dp", "cp"]


def data_parallel_index(mesh: DeviceMesh) -> int:
    """This rank's position among the data-parallel ranks (dp x cp, cp fastest): the same on
    every tp rank of one replica, which must start from the same weights."""
    return mesh["dp"].get_local_rank() * mesh["cp"].size() + mesh["cp"].get_local_rank()


def make_model(cfg: GPTConfig, mesh: DeviceMesh, seed: int, dtype: torch.dtype) -> GPT:
    """The GPT with this rank's tensor-parallel shards and context-parallel attention."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype)
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if mesh["cp"].size() > 1:
        enable_context_parallel(model, ContextParallel(mesh["cp"]))
    return model


def rank_part(batch: Batch, mesh: DeviceMesh, rows: bool = True) -> Batch:
    """This rank's rows (by dp coordinate; all of them without ``rows``: a sampler already
    took the replica's) and chunk of each sequence (by cp coordinate)."""
    out = []
    for t in batch:
        if rows:
            t = t.chunk(mesh["dp"].size(), dim=0)[mesh["dp"].get_local_rank()]
        out.append(t.chunk(mesh["cp"].size(), dim=1)[mesh["cp"].get_local_rank()])
    return out[0], out[1]


def micro_batch_loss(
    model: torch.nn.Module, batch: Batch, reduction: str, micro_batches: int
) -> torch.Tensor:
    """The loss whose gradient the reduction turns into the global one: a mean per micro-batch
    (``mean``; every token valid), a sum (``sum``), or a sum whose items are counted
    (``item_mean``)."""
    tokens, targets = batch
    logits = model(tokens)
    if reduction == "item_mean":
        assert isinstance(model, DistributedDataParallel)
        model.count_items(int((targets != -1).sum()))
    if reduction in ("sum", "item_mean"):
        return lm_loss(logits, targets, "sum")
    return lm_loss(logits, targets, "mean") / micro_batches


def train(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    mesh: DeviceMesh,
    *,
    reduction: str = "mean",
    micro_batches: int = 1,
) -> list[float]:
    """Train one optimizer step per global batch; returns this rank's local loss per step."""
    losses = []
    for batch in batches:
        tokens, targets = rank_part(batch, mesh)
        optimizer.zero_grad()
        total = 0.0
        parts = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches), strict=True))
        for i, part in enumerate(parts):
            sync = ddp.no_sync() if i < len(parts) - 1 else nullcontext()
            with sync:
                loss = micro_batch_loss(ddp, part, reduction, micro_batches)
                loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


def train_reference(
    cfg: GPTConfig,
    make_optimizer: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[Batch],
    *,
    seed: int,
    dtype: torch.dtype,
    reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """One process, the whole global batch each step: the parameters N ranks must end with."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype)
    optimizer = make_optimizer(model.parameters())
    for tokens, targets in batches:
        optimizer.zero_grad()
        logits = model(tokens)
        if reduction == "item_mean":
            loss = lm_loss(logits, targets, "sum") / (targets != -1).sum()
        elif reduction == "sum":
            loss = lm_loss(logits, targets, "sum")
        else:
            loss = lm_loss(logits, targets, "mean")
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
