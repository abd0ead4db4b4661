"""The parameters a ``ShardedOptimizer`` is built from: torch's forms of param groups, an
explicit bucket layout checked, and how two ranks' layouts differ."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync.errors import UsageError


def as_param_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as a list of param groups (torch's forms: tensors, or dicts)."""
    if isinstance(params, torch.Tensor):
        raise UsageError("params must be an iterable of tensors or of param-group dicts")
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        g = dict(g)
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        g["params"] = ps
        out.append(g)
    if not any(p.requires_grad for g in out for p in g["params"]):
        raise UsageError("ShardedOptimizer got no parameter that requires grad")
    return out


def explicit_buckets(
    param_groups: list[dict[str, Any]], buckets: Sequence[Sequence[torch.Tensor]]
) -> list[list[Any]]:
    """``buckets`` checked to hold each trainable parameter of ``param_groups`` exactly once,
    one dtype and device per bucket; empty ones dropped."""
    trainable = {id(p): p for g in param_groups for p in g["params"] if p.requires_grad}
    seen: set[int] = set()
    members = []
    for bi, bucket in enumerate(buckets):
        ps = list(bucket)
        for p in ps:
            if id(p) not in trainable:
                raise UsageError(
                    f"bucket {bi} holds a parameter of shape {list(p.shape)} that is not a "
                    f"trainable parameter of this optimizer"
                )
            if id(p) in seen:
                raise UsageError(f"a parameter of shape {list(p.shape)} is in two buckets")
            seen.add(id(p))
        if len({(p.dtype, p.device) for p in ps}) > 1:
            raise UsageError(f"bucket {bi} mixes dtypes or devices; a flat buffer holds one")
        if ps:
            members.append(ps)
    missing = [list(p.shape) for i, p in trainable.items() if i not in seen]
    if missing:
        raise UsageError(f"buckets leave out trainable parameters of shapes {missing}")
    return members


def first_difference(ref: list[Any], other: list[Any], rank: int) -> str:
    """Where rank ``rank``'s bucket layout (per bucket, per parameter) first differs from rank
    0's."""
    for bi, (a, b) in enumerate(zip(ref, other, strict=False)):
        for pi, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"parameter {pi} of bucket {bi} is {x} on rank 0 and {y} on rank {rank}"
        if len(a) != len(b):
            return f"bucket {bi} holds {len(a)} parameters on rank 0, {len(b)} on rank {rank}"
    return f"rank 0 has {len(ref)} buckets, rank {rank} has {len(other)}"
