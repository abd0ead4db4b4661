"""Sharded's state dicts: sharded for DCP (reshards to any world size), or full.

Each parameter's per-element state (Adam's ``exp_avg``...) is conceptually one global 1-D
tensor of ``numel(param)`` elements, of which a rank owns one contiguous range: possibly empty,
possibly uneven, wherever the bucket's slices cut. Scalar state (Adam's ``step``) is replicated.

Sharded (``torch.distributed.checkpoint``). DCP describes a sharded tensor by the chunks each
rank holds. DTensor cannot state our ranges (its ``Shard(0)`` chunks are ``torch.chunk``'s,
not arbitrary), and ShardedTensor, which could, is deprecated in torch 2.13. DCP also accepts
any tensor that implements the ``_Checkpointable`` protocol that DTensor itself implements
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, looked for in
``torch/distributed/checkpoint/planner_helpers.py`` and ``utils.py``), so
:class:`StateShard` is a tensor subclass with the global shape and no storage of its own that
names this rank's one chunk and hands DCP the live state tensor to write from or read into.
Loading at another world size is DCP's ordinary resharding: each rank asks for the ranges it
owns now, read from whichever saved chunks overlap them. Save with
``dcp.save(opt.sharded_state_dict())``; load with ``sd = opt.sharded_state_dict()``,
``dcp.load(sd)``, ``opt.load_sharded_state_dict(sd)`` (other state may share the dict: the
model, a scheduler).

Full (torch ``ZeroRedundancyOptimizer``'s shape). ``consolidate_state_dict(to)`` builds on rank
``to`` exactly what ``torch.optim.AdamW(...).state_dict()`` would hold, one parameter at a time:
each owner sends its range of that parameter's state straight into the result (point-to-point,
no padding, no gather buffer), so no rank ever holds more than its own state plus, on ``to``,
the result being built. ``load_state_dict`` of such a dict keeps only each rank's ranges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from gradsync.errors import UsageError
from gradsync.optim.buffers import FlatBucket
from gradsync.optim.layout import Piece

if TYPE_CHECKING:  # DCP is imported by whoever saves; a process that never saves skips it
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


class Sharded(Protocol):
    """What these functions read of a :class:`~gradsync.optim.Sharded`; they return
    what changes, and the optimizer, the only writer of its state, applies it."""

    buckets: list[FlatBucket]
    param_groups: list[dict[str, Any]]
    optim: torch.optim.Optimizer
    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None

    @property
    def steps(self) -> int: ...  # inner steps taken (the same on every rank)


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


class StateShard(torch.Tensor):
    """This rank's range ``[offset, offset + local.numel())`` of a global 1-D state tensor of
    ``numel`` elements, as DCP sees it. It only carries the state into and out of a checkpoint:
    any computation on it raises (use ``.local``, the live state tensor)."""

    local: torch.Tensor
    offset: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, numel: int, offset: int) -> StateShard:
        t = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device
        )
        t.local, t.offset = local, offset
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TypeError(f"StateShard only carries optimizer state to DCP; {func} is not for it")

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"StateShard(numel={self.shape[0]}, offset={self.offset}, local={self.local.numel()})"
        )

    def _chunk(self) -> ChunkStorageMetadata:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(
            offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()])
        )

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


def _per_element(key: str, value: Any, numel: int) -> bool:
    """Whether a state value is one entry per parameter element (sharded) or replicated."""
    return (
        isinstance(value, torch.Tensor)
        and key != "step"
        and value.dim() > 0
        and value.numel() == numel
    )


Owned = tuple[torch.Tensor, "FlatBucket | None", int, "Piece | None", Any]


def _owned(opt: Sharded) -> list[Owned]:
    """For every parameter in torch's state-dict order (groups in order): the parameter, its
    bucket and position there, this rank's piece of it and the piece's slice (or ``None``)."""
    where: dict[int, tuple[FlatBucket | None, int, Piece | None, Any]] = {}
    for b in opt.buckets:
        for i, p in enumerate(b.params):
            where[id(p)] = (b, i, None, None)
        for pc, s in zip(b.pieces, b.slices, strict=True):
            where[id(b.params[pc.param])] = (b, pc.param, pc, s)
    frozen = (None, -1, None, None)  # requires_grad=False at construction: no slice
    return [(p, *where.get(id(p), frozen)) for g in opt.param_groups for p in g["params"]]


def _hyper_groups(opt: Sharded) -> list[dict[str, Any]]:
    return [hyperparameters(g) for g in opt.param_groups]


# -- sharded: DCP --------------------------------------------------------------------------------
def step_on_zeros(opt: Sharded) -> None:
    """Create the inner optimizer's state with one step on zero gradients, then put the
    parameters back: before any step there is no state to load a checkpoint into (see
    ``ShardedOptimizer._init_state_for_load``). Hyper-parameters must be synchronised first."""
    slices = [s for b in opt.buckets for s in b.slices]
    saved = [b.shard.clone() for b in opt.buckets]
    for s in slices:
        s.grad = torch.zeros_like(s)
    try:
        opt.optim.step()
    finally:
        for b, before in zip(opt.buckets, saved, strict=True):
            b.detach_grads()
            b.shard.copy_(before)


def sharded_state_dict(opt: Sharded) -> dict[str, Any]:
    """This rank's share of the state, keyed like ``torch.optim.Optimizer.state_dict`` (by
    parameter position): per-element state as :class:`StateShard` (its range only; a rank
    holding none of a parameter lists no entry for it), scalars and hyper-parameters as they
    are (replicated: DCP writes one copy). The tensors are the live state: DCP saves from them,
    and loads into them. Before the first step the state must have been made
    (:func:`step_on_zeros`)."""
    state: dict[str, Any] = {}
    for k, (p, _b, _i, pc, s) in enumerate(_owned(opt)):
        if pc is None or s not in opt.optim.state:
            continue
        entry = {}
        for key, value in opt.optim.state[s].items():
            if _per_element(key, value, pc.numel):
                entry[key] = StateShard(value, p.numel(), pc.start)
            else:
                entry[key] = value
        state[str(k)] = entry
    return {"state": state, "param_groups": _hyper_groups(opt), "steps": opt.steps}


def load_sharded(opt: Sharded, state_dict: dict[str, Any]) -> int:
    """After ``dcp.load`` into :func:`sharded_state_dict`'s dict: the tensors are already in
    place; apply the hyper-parameters; returns the saved step count."""
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise UsageError(
            f"the checkpoint has {len(groups)} param groups, this optimizer {len(opt.param_groups)}"
        )
    for outer, saved in zip(opt.param_groups, groups, strict=True):
        outer.update({k: v for k, v in saved.items() if k != "params"})
    steps = int(state_dict["steps"])
    if steps == 0:  # saved before the first step: nothing real was in it
        opt.optim.state.clear()
    return steps


# -- full: consolidate on one rank, load everywhere ----------------------------------------------
def _schemas(opt: Sharded) -> list[dict[str, Any] | None]:
    """For every parameter, from the rank holding its first element: each state key's kind
    (``("shard", dtype)`` or ``("value", value)``), gathered to every rank (small objects)."""
    mine: dict[int, dict[str, Any]] = {}
    for k, (_p, _b, _i, pc, s) in enumerate(_owned(opt)):
        if pc is None or pc.start != 0 or s not in opt.optim.state:
            continue
        mine[k] = {
            key: ("shard", v.dtype) if _per_element(key, v, pc.numel) else ("value", v)
            for key, v in opt.optim.state[s].items()
        }
    everyone: list[Any] = [None] * opt.world_size
    if opt.world_size == 1:
        everyone = [mine]
    else:
        dist.all_gather_object(everyone, mine, group=opt.process_group)
    merged: dict[int, dict[str, Any]] = {}
    for part in everyone:
        merged.update(part)
    return [merged.get(k) for k in range(len(_owned(opt)))]


def consolidate(opt: Sharded, to: int) -> dict[str, Any] | None:
    """The full state dict on rank ``to`` (``None`` elsewhere); a collective."""
    if not 0 <= to < opt.world_size:
        raise UsageError(f"consolidate_state_dict(to={to}) is outside a group of {opt.world_size}")
    owned = _owned(opt)
    schemas = _schemas(opt)
    full: dict[int, dict[str, Any]] = {}
    for k, ((p, b, i, pc, s), schema) in enumerate(zip(owned, schemas, strict=True)):
        if schema is None or b is None:
            continue
        entry: dict[str, Any] = {}
        for key, (kind, info) in sorted(schema.items()):
            if kind == "value":
                entry[key] = info.clone() if isinstance(info, torch.Tensor) else info
                continue
            mine = opt.optim.state[s][key] if pc is not None else None
            entry[key] = _gather_one(opt, to, b.layout.owners(i), mine, p, info)
        if opt.rank == to:
            full[k] = entry
    if opt.rank != to:
        return None
    params: list[dict[str, Any]] = []
    start = 0
    for g in _hyper_groups(opt):
        n = len(opt.param_groups[len(params)]["params"])
        params.append({**g, "params": list(range(start, start + n))})
        start += n
    return {"state": full, "param_groups": params}


def _gather_one(
    opt: Sharded,
    to: int,
    owners: list[tuple[int, Piece]],
    mine: torch.Tensor | None,
    param: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """One parameter's per-element state, assembled on ``to`` from each owner's range."""
    if opt.rank != to:
        if mine is not None:
            dist.send(mine.contiguous(), group=opt.process_group, group_dst=to)
        return None
    out = torch.empty(param.numel(), dtype=dtype, device=param.device)
    for r, pc in owners:
        target = out[pc.start : pc.end]
        if r == to:
            assert mine is not None
            target.copy_(mine)
        else:
            dist.recv(target, group=opt.process_group, group_src=r)
    return out.view(param.shape)


def load_full(opt: Sharded, state_dict: dict[str, Any]) -> bool:
    """Load an unsharded state dict (torch's shape) on every rank; keep this rank's ranges.
    Returns whether it held any state (a step was taken before it was saved)."""
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in opt.param_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise UsageError(
            f"the state dict's param groups hold {[len(g['params']) for g in groups]} "
            f"parameters, this optimizer's {sizes}"
        )
    ids = [i for g in groups for i in g["params"]]
    inner_state: dict[int, dict[str, Any]] = {}
    position = {
        id(s): j for j, s in enumerate(s for g in opt.optim.param_groups for s in g["params"])
    }
    for k, (p, _b, _i, pc, s) in enumerate(_owned(opt)):
        saved = state_dict["state"].get(ids[k])
        if pc is None or saved is None:
            continue
        inner_state[position[id(s)]] = {
            key: v.reshape(-1)[pc.start : pc.end].clone()
            if isinstance(v, torch.Tensor) and key != "step" and v.shape == p.shape
            else v
            for key, v in saved.items()
        }
    inner_groups, j = [], 0
    for outer, saved_group, inner in zip(
        opt.param_groups, groups, opt.optim.param_groups, strict=True
    ):
        outer.update({k: v for k, v in saved_group.items() if k != "params"})
        n = len(inner["params"])
        inner_groups.append({**hyperparameters(outer), "params": list(range(j, j + n))})
        j += n
    opt.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    return bool(state_dict["state"])
