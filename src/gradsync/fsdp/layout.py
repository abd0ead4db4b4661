"""Which modules FSDP2 manages, on which mesh, and the layouts gradsync refuses up front.

torch's ``fully_shard`` turns each module it is applied to into an ``FSDPModule`` with one
parameter group: the parameters of its subtree that no nested ``FSDPModule`` claims, each now a
DTensor sharded on the mesh it was given. That group's gradients are reduce-scattered over
that mesh after its backward, and FSDP2 calls the module's all-reduce hook with the result:
the seam gradsync synchronises through. Everything here reads public torch API only (module
types, DTensor meshes and placements, process-group ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gradsync.errors import ModelMismatchError, UsageError
from gradsync.failfast.deadline import Deadline


def fsdp_modules(module: nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every ``FSDPModule`` in ``module``'s tree with its name, root first; the root must be
    one (``fully_shard(model)`` last, as torch and torchtitan do)."""
    if not isinstance(module, FSDPModule):
        raise UsageError(
            f"replicate_gradients needs a module sharded with torch's fully_shard (an "
            f"FSDPModule), got {type(module).__name__}: call fully_shard(block, mesh=...) on "
            f"each block and fully_shard(model, mesh=...) on the root first"
        )
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def managed_parameters(module: FSDPModule) -> dict[str, nn.Parameter]:
    """The parameters of ``module``'s FSDP2 group: its subtree's, minus those of nested
    ``FSDPModule`` subtrees (which have groups of their own)."""
    assert isinstance(module, nn.Module)  # fully_shard made it both
    nested = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    claimed = {id(p) for m in nested for p in m.parameters()}
    return {n: p for n, p in module.named_parameters() if id(p) not in claimed}


def _mesh_name(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    return f"mesh {list(names)}" if names else f"a {mesh.ndim}-D mesh"


def shard_mesh(modules: list[tuple[str, FSDPModule]]) -> DeviceMesh:
    """The one 1-D mesh every module is sharded over; refuses torch's own hybrid sharding
    (its replicate axis would be all-reduced twice) and parameters left out of FSDP2 (nobody
    would synchronise their gradients)."""
    found: DeviceMesh | None = None
    for name, module in modules:
        for pname, p in managed_parameters(module).items():
            where = f"{name}.{pname}" if name else pname
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor):
                raise UsageError(
                    f"parameter '{where}' is not sharded by fully_shard (ignored_params?): "
                    f"neither FSDP2 nor gradsync would synchronise its gradient"
                )
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise UsageError(
                    f"parameter '{where}' is sharded by fully_shard over {_mesh_name(mesh)}: "
                    f"that is torch's own hybrid sharding, which all-reduces over the "
                    f"replicate axis itself. Give fully_shard the shard axis alone "
                    f"(mesh['shard']) and replicate_gradients the other"
                )
            if found is not None and mesh != found:
                raise UsageError(
                    f"parameter '{where}' is sharded over {_mesh_name(mesh)}, others over "
                    f"{_mesh_name(found)}: replicate_gradients needs one shard mesh"
                )
            found = mesh
    if found is None:
        raise UsageError("replicate_gradients: the module has no trainable parameters")
    return found


def check_axes_apart(shard: DeviceMesh, group: dist.ProcessGroup, mesh: DeviceMesh) -> None:
    """gradsync's ranks and FSDP2's shard ranks must meet in this rank only: a rank in both
    would have its shard summed twice, or shards of different rows summed together."""
    shard_ranks = set(dist.get_process_group_ranks(shard.get_group()))
    ours = set(dist.get_process_group_ranks(group))
    both = sorted(shard_ranks & ours)
    if len(both) > 1:
        raise UsageError(
            f"replicate_gradients got {_mesh_name(mesh)}, whose ranks {both} are also "
            f"ranks of the fully_shard mesh ({_mesh_name(shard)}): gradsync must reduce over "
            f"the other axes (mesh['replicate'] or mesh['cp']), never the shard axis"
        )


def describe(modules: list[tuple[str, FSDPModule]]) -> list[tuple[str, tuple[int, ...], str]]:
    """Each trainable parameter's name, global shape and dtype: what every rank must agree on."""
    rows = []
    for name, module in modules:
        for pname, p in managed_parameters(module).items():
            if p.requires_grad:
                rows.append((f"{name}.{pname}" if name else pname, tuple(p.shape), str(p.dtype)))
    return rows


def check_same_everywhere(
    across: Deadline, shard: Deadline, settings: dict[str, str], rows: list
) -> list[int]:
    """Every data-parallel rank holds the same settings and parameters, else every one of
    them raises the same :class:`ModelMismatchError`, naming a rank that differs. Returns the
    global ranks of every data-parallel rank, sorted.

    Two gathers cover the grid: each rank gathers its group across (gradsync's ranks), then
    gathers those over its shard group, so every rank ends with every rank's entry (a rank
    that compared only with its two neighbours could see nothing wrong while another raised,
    and wait for it until the deadline)."""
    me = dist.get_rank()
    row_of_group = across.gather_objects({me: (settings, rows)}, "replicate_gradients: check")
    mine = {r: entry for part in row_of_group for r, entry in part.items()}
    every = {
        r: e
        for part in shard.gather_objects(mine, "replicate_gradients: check")
        for r, e in part.items()
    }
    first = min(every)
    ref_settings, ref_rows = every[first]
    for r in sorted(every):
        their_settings, their_rows = every[r]
        for key, value in ref_settings.items():
            if their_settings.get(key) != value:
                raise ModelMismatchError(
                    f"replicate_gradients setting {key!r} differs across ranks: rank {first} "
                    f"has {value!r}, rank {r} has {their_settings.get(key)!r}"
                )
        if their_rows != ref_rows:
            a, b = _first_difference(ref_rows, their_rows)
            raise ModelMismatchError(
                f"ranks hold different models: rank {first} has {a}, rank {r} has {b}"
            )
    return sorted(every)


def _first_difference(a: list, b: list) -> tuple[object, object]:
    """The first pair of rows where ``a`` and ``b`` differ (``None`` past the shorter's end)."""
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x != y:
            return x, y
    return None, None


def grads_become_views(params: Sequence[torch.Tensor], output: torch.Tensor) -> bool:
    """Whether FSDP2 will hand ``output`` (a group's reduce-scatter output) to the parameters
    as views of it, untouched: no gradient to add it to, no cast, no copy to the host, no
    post-accumulate-grad hook reading it (see [Note: overlap] in ``replicate.py``)."""
    for p in params:
        if p.grad is not None or p.dtype != output.dtype or p.device != output.device:
            return False
        if getattr(p, "_post_accumulate_grad_hooks", None):  # torch's; read by FSDP2 too
            return False
    return True


def gradients_held_back(module: nn.Module) -> bool:
    """Whether FSDP2 holds gradients of micro-batches run with
    ``set_requires_gradient_sync(False)`` and not yet reduced: an accumulation window is open,
    and a checkpoint taken now would lose them. FSDP2 keeps them on its unsharded parameters
    (torch's internals, read defensively: a torch that moved them reads as no window)."""
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", ()):
            for fsdp_param in getattr(group, "fsdp_params", ()):
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    return True
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    return True
    return False


def wrap_collectives(module: FSDPModule, wrap: Callable[[Any], Any]) -> None:
    """Replace each of FSDP2's parameter groups' all-gather and reduce-scatter of ``module``
    (its own, or one set with ``set_custom_all_gather`` / ``set_custom_reduce_scatter``) with
    ``wrap(it)``. Read from torch's internals defensively: a torch that moved them is left as
    it is."""
    for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
        if hasattr(group, "_all_gather_comm") and hasattr(group, "_reduce_scatter_comm"):
            group._all_gather_comm = wrap(group._all_gather_comm)
            group._reduce_scatter_comm = wrap(group._reduce_scatter_comm)
