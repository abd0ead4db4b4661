"""DTensor parameters in gradsync's flat buckets: their local shards travel, DTensors come back.

A tensor-parallel parameter is a ``DTensor``: each rank holds a local shard (or a replica) and
the DTensor records on which mesh and with which placements. Data parallelism over such a
parameter is data parallelism over its *local shard*: the ranks that hold the same shard (the
same position on every non-data-parallel axis) saw different data, and the sum of their local
gradients is the local shard of the full gradient. So the bucket holds local shards, and the
reduced shard is handed back as a DTensor with the parameter's mesh and placements, which is
what the user's optimizer and ``clip_grad_norm_`` expect. No DTensor is ever swapped for a
plain tensor around the forward (torch's DDP does that, and only for a 1-D mesh).

[Note: Partial gradients]
The gradient of a replicated parameter used on sharded activations (a sequence-parallel
LayerNorm) comes out ``Partial`` on the tensor-parallel axis: each rank holds a summand, not the
gradient. Summing it over the data-parallel ranks and labelling the result with the
parameter's ``Replicate`` placement would be silently wrong. gradsync resolves it first: the
gradient is redistributed to the parameter's placements (a sum over the tensor-parallel ranks,
done by DTensor on its own group) as it arrives, before it enters the bucket. Torch's
optimizers would run the same redistribution at their first use of the gradient, so this moves
a collective rather than adding one, and afterwards every gradient has its parameter's
placements, on ranks that got a gradient and on ranks that did not alike. A ``Partial`` on an
axis that is *inside* the data-parallel mesh cannot be resolved that way (gradsync's own sum
would count it twice) and raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from gradsync.errors import UsageError


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (``t`` itself otherwise), without autograd bookkeeping:
    ``to_local()`` is an autograd function, too slow for a per-gradient hook."""
    return t._local_tensor if isinstance(t, DTensor) else t


def placement_text(t: torch.Tensor) -> str:
    """How ``t`` is distributed, for the cross-rank model check: '' for a plain tensor."""
    if not isinstance(t, DTensor):
        return ""
    names = t.device_mesh.mesh_dim_names or tuple(str(a) for a in range(t.device_mesh.ndim))
    return ", ".join(f"{n}: {p!r}" for n, p in zip(names, t.placements, strict=True))


def _overlapping_axes(param: DTensor, dp_ranks: set[int]) -> list[int]:
    """Axes of ``param``'s mesh along which some other rank is also one of the data-parallel
    ranks of this rank: gradsync would sum over those ranks."""
    mesh = param.device_mesh
    out = []
    for axis in range(mesh.ndim):
        ranks = set(dist.get_process_group_ranks(mesh.get_group(axis)))
        if len(ranks & dp_ranks) > 1:
            out.append(axis)
    return out


class GradLayout:
    """The mesh, placements and global shape of one DTensor parameter, to turn its gradient
    into a local shard for the bucket and the reduced shard back into a DTensor."""

    def __init__(self, name: str, param: DTensor, dp_ranks: set[int]) -> None:
        self.name = name
        self.mesh = param.device_mesh
        self.placements = tuple(param.placements)
        self.shape = param.shape
        self.stride = param.stride()
        self.dp_axes = _overlapping_axes(param, dp_ranks)

    def matches(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is a DTensor laid out like the parameter."""
        return isinstance(grad, DTensor) and tuple(grad.placements) == self.placements

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local shard of ``grad`` with the parameter's placements (see [Note: Partial
        gradients])."""
        if not isinstance(grad, DTensor):
            raise UsageError(
                f"parameter '{self.name}' is a DTensor but its gradient is a plain "
                f"{type(grad).__name__}; assign DTensor gradients to DTensor parameters"
            )
        if tuple(grad.placements) != self.placements:
            self.refuse_on_dp_axes(
                grad.placements,
                f"the gradient of parameter '{self.name}'",
                "summing it there again would count it twice. Leave that axis out of the "
                "data-parallel mesh.",
            )
            grad = grad.redistribute(self.mesh, self.placements)
        return grad._local_tensor

    def wrap(self, shard: torch.Tensor) -> DTensor:
        """``shard`` (a reduced local gradient) as a DTensor laid out like the parameter."""
        return DTensor.from_local(
            shard,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )

    def refuse_on_dp_axes(self, placements: Sequence[Placement], what: str, why: str) -> None:
        """Raise unless ``placements`` replicate along every axis gradsync reduces over."""
        for axis in self.dp_axes:
            if not placements[axis].is_replicate():
                names = self.mesh.mesh_dim_names
                name = repr(names[axis]) if names else str(axis)
                raise UsageError(
                    f"{what} is {placements[axis]!r} on mesh axis {name}, which is part of the "
                    f"data-parallel mesh: {why}"
                )


def grad_layouts(
    named_params: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> list[GradLayout | None]:
    """For each *trainable* parameter, a :class:`GradLayout` if it is a DTensor, else ``None``;
    after checking that no parameter is sharded across ranks that ``group`` would average (see
    [Note: which mesh axes are summed] in ``axes.py``). Every rank of the group holds the same
    layout, so every rank raises alike."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if not any(isinstance(p, DTensor) for _, p in named):
        return [None] * len(named)
    pg = group if group is not None else dist.group.WORLD
    dp_ranks = set(dist.get_process_group_ranks(pg))
    layouts: list[GradLayout | None] = []
    for name, p in named:
        if not isinstance(p, DTensor):
            layouts.append(None)
            continue
        layout = GradLayout(name, p, dp_ranks)
        layout.refuse_on_dp_axes(
            layout.placements,
            f"parameter '{name}'",
            "its ranks hold different shards, which must never be averaged. Pass only the axes "
            "whose ranks saw different data, e.g. device_mesh=mesh['dp'] or mesh['dp', 'cp'] "
            "(never the tensor-parallel axis).",
        )
        layouts.append(layout)
    return layouts
