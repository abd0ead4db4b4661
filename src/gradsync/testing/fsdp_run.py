"""Training the demo GPT sharded with torch's ``fully_shard``, gradients synchronised by gradsync
over the other axes, on a (replicate, shard, cp) mesh; and torch's own hybrid sharding.

Every rank is given the *global* batch of each step and takes its part: rows by its
(replicate, shard) coordinate, a chunk of every sequence by its cp coordinate. FSDP2 shards
over ``shard``; gradsync reduces over ``replicate`` and ``cp`` (flattened into one group).
The one-process run these must equal is ``mesh_run.train_reference``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gradsync.fsdp import ReplicatedGradients, replicate_gradients
from gradsync.testing.gpt import GPT, GPTConfig, enable_context_parallel, lm_loss
from gradsync.testing.parallel import ContextParallel

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), each (batch, time)


@dataclass(frozen=True)
class FSDPLayout:
    """Sizes of the mesh axes; their product is the world size."""

    replicate: int = 1
    """Replicas of the sharded model (across nodes), fed different rows."""
    shard: int = 2
    """FSDP2's axis: ranks holding different shards of the weights, fed different rows."""
    cp: int = 1
    """Context parallel: ranks holding different chunks of the same sequences."""

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.cp

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        return init_device_mesh(
            device_type,
            (self.replicate, self.shard, self.cp),
            mesh_dim_names=("replicate", "shard", "cp"),
        )


def gradsync_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The axes gradsync reduces over: every data-parallel axis but FSDP2's."""
    return mesh["replicate", "cp"]


def make_model(cfg: GPTConfig, mesh: DeviceMesh, dtype: torch.dtype, seed: int = 0) -> GPT:
    """The GPT, the same weights on every rank, with context-parallel attention if cp > 1
    (not sharded yet)."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype)
    if mesh["cp"].size() > 1:
        enable_context_parallel(model, ContextParallel(mesh["cp"]))
    return model


def shard(model: GPT, mesh: DeviceMesh) -> FSDPModule:
    """torchtitan's layout: each block its own FSDP2 group, then the root (embeddings, head)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    return model


def parallelize(
    model: GPT, mesh: DeviceMesh, reduction: str, timeout: float = 60.0
) -> ReplicatedGradients:
    """FSDP2 over ``shard``, gradsync over the rest."""
    shard(model, mesh["shard"])
    return replicate_gradients(model, gradsync_mesh(mesh), reduction=reduction, timeout=timeout)


def rank_part(batch: Batch, mesh: DeviceMesh) -> Batch:
    """This rank's rows (by (replicate, shard) coordinate) and chunk of each sequence (by cp)."""
    rows = mesh["replicate"].size() * mesh["shard"].size()
    index = mesh["replicate"].get_local_rank() * mesh["shard"].size()
    index += mesh["shard"].get_local_rank()
    out = [t.chunk(rows, dim=0)[index] for t in batch]
    out = [t.chunk(mesh["cp"].size(), dim=1)[mesh["cp"].get_local_rank()] for t in out]
    return out[0], out[1]


def train(
    model: nn.Module,
    sync: ReplicatedGradients | None,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    mesh: DeviceMesh,
    *,
    reduction: str = "mean",
    micro_batches: int = 1,
    set_to_none: bool = True,
) -> list[float]:
    """One optimizer step per global batch, its rows cut into ``micro_batches`` accumulated
    without communication (FSDP2's ``set_requires_gradient_sync(False)``) but the last.
    ``set_to_none=False`` zeroes the gradients in place: FSDP2 then adds each step's reduced
    shard into the existing ``.grad``."""
    assert isinstance(model, FSDPModule)
    losses = []
    for batch in batches:
        tokens, targets = rank_part(batch, mesh)
        optimizer.zero_grad(set_to_none=set_to_none)
        total = 0.0
        parts = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches), strict=True))
        for i, (x, y) in enumerate(parts):
            model.set_requires_gradient_sync(i == len(parts) - 1)
            logits = model(x)
            if reduction == "item_mean":
                assert sync is not None
                sync.count_items(int((y != -1).sum()))
            if reduction == "mean":
                loss = lm_loss(logits, y, "mean") / micro_batches
            else:
                loss = lm_loss(logits, y, "sum")
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


def train_torch_hsdp(
    cfg: GPTConfig,
    mesh: DeviceMesh,
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[Batch],
    dtype: torch.dtype,
) -> GPT:
    """torch's own hybrid sharding (``fully_shard`` over the 2-D (replicate, shard) mesh), mean
    reduction: what gradsync's replicate axis must equal where torch covers the case."""
    model = make_model(cfg, mesh, dtype)
    shard(model, mesh["replicate", "shard"])
    optimizer = make_optimizer(model.parameters())
    train(model, None, optimizer, batches, mesh)
    return model
