"""Tensor and context parallelism for the demo GPT: what a 3-D (dp, cp, tp) run needs besides
gradsync.

- Tensor parallelism (TP) is torch's own ``parallelize_module``: in each block the fused
  query/key/value projection and the MLP's first linear layer are split by output rows
  (column-parallel: each rank computes some heads / hidden units), the attention output
  projection and the MLP's second layer by input columns (row-parallel: partial sums, reduced
  over tp by DTensor). Embeddings and LayerNorms stay plain, replicated tensors.
- Context parallelism (CP) splits every sequence into ``cp`` contiguous chunks, one per rank.
  Attention needs the keys and values of earlier chunks, so they are all-gathered over cp
  (with autograd: the backward sums each chunk's key/value gradients from every rank's queries
  and hands each rank its own) and a causal mask offset by the chunk's start keeps every query
  to its past. Each rank's loss covers its own chunk's tokens; the gradient of the whole
  sequence is the *sum* over cp ranks, which is why gradsync reduces over dp and cp together.
- Sequence parallelism: :class:`SequenceParallelNet`, a LayerNorm on each tp rank's chunk of
  every sequence, whose weight's gradient comes out ``Partial`` over tp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _GatherChunks(torch.autograd.Function):
    """All-gather along the time axis (dim 2 of (batch, heads, time, head_dim)) over a group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's queries looked at every chunk: sum their gradients, keep our chunk's.
        # (A reduce-scatter would move fewer bytes; an all-reduce is the readable version.)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=2)[rank].contiguous(), None


class ContextParallel:
    """This rank's place in a context-parallel mesh axis: which chunk of each sequence it holds.

    It holds the 1-D mesh, not its process group, and asks the mesh for the group at each
    use: a mesh laid out again after a lost replica ([Note: a mesh rebuilt in place]) has new
    groups, and this rank keeps its place on the axis."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def size(self) -> int:
        return self.mesh.size()

    def start(self, chunk_len: int) -> int:
        """Position of this rank's first token in the full sequence."""
        return self.rank * chunk_len

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``t`` (batch, time, ...) along time."""
        return t.chunk(self.size, dim=1)[self.rank]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherChunks.apply(x, self.group)

    def causal_mask(self, chunk_len: int, device: torch.device) -> torch.Tensor:
        """(chunk_len, full_len) booleans: query i (at start + i) sees key j iff j <= start + i."""
        queries = torch.arange(chunk_len, device=device)[:, None] + self.start(chunk_len)
        keys = torch.arange(chunk_len * self.size, device=device)[None, :]
        return keys <= queries


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard every block's attention and MLP over the 1-D mesh ``tp_mesh`` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for name, _ in model.named_modules():
        if name.endswith("attn.qkv") or name.endswith("mlp.0"):
            plan[name] = ColwiseParallel()
        elif name.endswith("attn.proj") or name.endswith("mlp.2"):
            plan[name] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor: DTensors are gathered over their mesh (a
    collective: every rank of the mesh must call this)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


SP_DIM = 4  # the features of SequenceParallelNet's input


class SequenceParallelNet(nn.Module):
    """A LayerNorm on sequence chunks (its weight's gradient comes out ``Partial`` over tp),
    then a column- and a row-parallel linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(SP_DIM)
        self.fc1 = nn.Linear(SP_DIM, 8)
        self.fc2 = nn.Linear(8, SP_DIM)
        self.tp_rank: int | None = None
        self.tp_size: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size is not None and self.tp_rank is not None:  # this rank's chunk of
            x = x.chunk(self.tp_size, dim=1)[self.tp_rank]  # every sequence, for the SP norm
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


def sequence_parallel_net(mesh: Any | None) -> SequenceParallelNet:
    """The net in float64, its norm non-trivial; over ``mesh``'s tp axis (``None``: one
    process, the reference)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = SequenceParallelNet().double()
    with torch.no_grad():  # a non-trivial norm, so its gradient matters
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.5, 0.5)
    if mesh is not None:
        tp = mesh["tp"]
        model.tp_rank, model.tp_size = tp.get_local_rank(), tp.size()
        plan = {
            "ln": SequenceParallel(use_local_output=False),
            "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, tp, plan)
    return model
