"""A ZeRO-1 optimizer's state after a loss: every slice from who holds it, cut again for the
survivors ([Note: ZeRO-1 under Recovery] in ``zero.py``).

Pure of recovery's bookkeeping: these functions run on the survivors' new default group, with
the old group's layout still in the optimizer, and leave it laid out for the new group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.optim import state
from gradsync.optim.buffers import FlatBucket
from gradsync.optim.layout import plan_shards
from gradsync.optim.mirror import Mirror
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.recovery.membership import NoRecoveryError

# One old slice, as its source sends it: per bucket, the slice's parameters and the state of
# each of its pieces (None: a piece with no state yet).
Held = list[tuple[torch.Tensor, list[dict[str, Any] | None]]]


def refuse_lost_pairs(world_size: int, survivors: set[int]) -> None:
    """``NoRecoveryError`` if an owner and its buddy (rank ``j`` and ``j - 1``) were both lost:
    ``j``'s slices of the optimizer state are then nowhere."""
    pairs = [
        ((j - 1) % world_size, j)
        for j in range(world_size)
        if j not in survivors and (j - 1) % world_size not in survivors
    ]
    if pairs and world_size > 1:
        named = "; ".join(
            f"rank {j}'s slices lived on rank {j} and, mirrored, on its buddy rank {b}"
            for b, j in pairs
        )
        raise NoRecoveryError(
            f"lost ranks {sorted({r for p in pairs for r in p})} together, each next to the "
            f"other: {named}, and both are gone, so that part of the ZeRO-1 optimizer state "
            "exists nowhere else"
        )


def roll_forward(
    opt: ShardedOptimizer, mirror: Mirror, holder: int, grads: list[torch.Tensor | None] | None
) -> bool:
    """The loss split the survivors: some stepped their slices, others had not. Rank ``holder``
    of the new group (one that stepped, still inside that step: no one could finish it)
    sends the step's gradient (``grads``, the parameters' ``.grad`` its slices stepped
    from); a survivor that had not stepped (``grads`` ``None``) steps its own slices and its
    mirror from it, as it would have, without the gathers. Returns whether it stepped."""
    params = [p for b in opt.buckets for p in b.params]
    mask: list[Any] = [None if grads is None else [g is not None for g in grads]]
    dist.broadcast_object_list(mask, group_src=holder)
    received: list[torch.Tensor | None] = []
    for p, has, mine in zip(params, mask[0], grads or [None] * len(params), strict=True):
        if has:
            g = mine if mine is not None else torch.empty_like(p)
            dist.broadcast(g, group_src=holder)
            received.append(g)
        else:
            received.append(None)
    if grads is not None:
        return False
    with torch.no_grad():
        for p, got in zip(params, received, strict=True):
            p.grad = got
        try:
            opt.step_and_gather(mirror.around(lambda b: None))
            mirror.step()
        finally:
            for p in params:
                p.grad = None
    return True


def recut(opt: ShardedOptimizer, mirror: Mirror, members: list[int]) -> None:
    """Every slice of the old group's layout from its source (its owner, else the owner's
    buddy), assembled on every member of the new default group (the parameters into the flat
    buffers, the state into a full state dict), then the optimizer and the mirror cut again for
    the new group. ``members``: the old ranks, in new rank order. Every member's own slice and
    mirror must hold the same step's values (its result, or its start)."""
    old_size, me = opt.world_size, members[dist.get_rank()]
    survivors = set(members)
    mine: dict[int, Held] = {me: _held(opt.buckets, opt.optim, me)}
    buddy_of = mirror.neighbour
    if mirror.on and buddy_of not in survivors:
        mine[buddy_of] = _held([mb for mb in mirror.buckets], mirror.optim, buddy_of)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    held: dict[int, Held] = {}
    for part in everyone:
        held.update(part)
    assert sorted(held) == list(range(old_size)), sorted(held)
    full = _full_state(opt, held)
    with torch.no_grad():
        for i, b in enumerate(opt.buckets):
            b.data.copy_(torch.cat([held[j][i][0] for j in range(old_size)]))
    _lay_out(opt, dist.get_rank(), dist.get_world_size())
    state.load_full(opt, full)
    mirror.build()
    mirror.sync(None)


def _held(buckets: list[Any], optim: torch.optim.Optimizer, rank: int) -> Held:
    """The values of one slice this rank holds (its own, or its mirror of ``rank``'s)."""
    out: Held = []
    for b in buckets:
        states = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim.state[s].items()}
            if s in optim.state
            else None
            for s in b.slices
        ]
        out.append((b.shard.detach().clone(), states))
    return out


def _full_state(opt: ShardedOptimizer, held: dict[int, Held]) -> dict[str, Any]:
    """torch's full state dict (``torch.optim.AdamW(...).state_dict()``'s shape) from every old
    slice: each parameter's per-element state joined from its pieces, in element order."""
    full: dict[int, dict[str, Any]] = {}
    where = {id(p): (bi, i) for bi, b in enumerate(opt.buckets) for i, p in enumerate(b.params)}
    ordered = [p for g in opt.param_groups for p in g["params"]]
    for k, p in enumerate(ordered):
        if id(p) not in where:
            continue  # frozen at construction: no slice, no state
        bi, i = where[id(p)]
        layout = opt.buckets[bi].layout
        parts = []
        for j, pc in layout.owners(i):
            position = layout.pieces(j).index(pc)
            parts.append(held[j][bi][1][position])
        if not parts or any(part is None for part in parts):
            continue  # not stepped yet
        entry: dict[str, Any] = {}
        for key, value in parts[0].items():  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0:
                joined = torch.cat([part[key] for part in parts])  # type: ignore[index]
                entry[key] = joined.view(p.shape)
            else:
                entry[key] = value
        full[k] = entry
    groups, start = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**state.hyperparameters(g), "params": list(range(start, start + n))})
        start += n
    return {"state": full, "param_groups": groups}


def _lay_out(opt: ShardedOptimizer, rank: int, world_size: int) -> None:
    """Cut every bucket again for ``world_size`` ranks (the parameters keep their values, now
    in new flat buffers), with an inner optimizer of no state over this rank's new slices."""
    members = [b.params for b in opt.buckets]
    layouts = plan_shards([[p.numel() for p in m] for m in members], world_size, opt.align)
    opt.rank, opt.world_size, opt.process_group = rank, world_size, None
    opt.buckets = [
        FlatBucket(i, m, layout, rank)
        for i, (m, layout) in enumerate(zip(members, layouts, strict=True))
    ]
    opt.optim.state.clear()
    opt.optim.param_groups.clear()
    for g in opt.param_groups:
        mine = {id(p) for p in g["params"]}
        slices = [
            s
            for b in opt.buckets
            for pc, s in zip(b.pieces, b.slices, strict=True)
            if id(b.params[pc.param]) in mine
        ]
        opt.optim.add_param_group({**state.hyperparameters(g), "params": slices})
