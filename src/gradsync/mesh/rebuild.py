"""A device mesh laid out again over new ranks, in place, for everything that holds it.

[Note: a mesh rebuilt in place]
A mesh is held in many places: each DTensor parameter, gradient and optimizer state records the
(sub-)mesh it lives on, tensor-parallel modules hold theirs in the closures of their forward
hooks, and the training loop holds the root. When the survivors of a lost replica go on over a
new default group ([Note: a mesh under Recovery] in ``recovery/replicas.py``), every one of them
must reach the new groups. References in closures cannot be found and replaced, so the objects
are kept and their contents change: the root is initialised again over the new layout of ranks
(``DeviceMesh.__init__`` on the same object, which creates its groups, a collective), each
flattened mesh of it is flattened again under its name, and every sub-mesh object still alive
takes the state of the same slice of the new root. Axis names stay; every axis but the one
that lost replicas keeps its size, and every rank its coordinates on those axes, so each
DTensor's local shard is still the right one.

What is not a mesh is not rebuilt: a ``ProcessGroup`` taken from a mesh earlier
(``mesh.get_group()``) belongs to the old groups and is gone. Hold the mesh, and ask it for its
group where the group is used.
"""

from __future__ import annotations

import gc
import itertools

import torch
from torch.distributed.device_mesh import DeviceMesh


def held_submeshes(root: DeviceMesh) -> list[DeviceMesh]:
    """Every mesh object of this process sliced or flattened from ``root``: the objects to
    update. The garbage collector is asked because closures hold some of them (about 50 ms
    for a process of a quarter million objects; by exact type, as ``isinstance`` would run the
    type checks of torch's opaque objects, slower and with warnings)."""
    found = [m for m in gc.get_objects() if type(m) is DeviceMesh and m is not root]
    return [m for m in found if m._get_root_mesh() is root]


def flattened_axes(root: DeviceMesh) -> dict[str, tuple[str, ...]]:
    """The axes of ``root`` that each of its flattened meshes joins, by the flattened name."""
    names = root.mesh_dim_names or ()
    out = {}
    for name, flat in root._flatten_mapping.items():
        # by layout, not by the ranks a slice holds: those are looked up by this rank's rank,
        # which the new default group has changed
        for dims in itertools.chain(
            *(itertools.combinations(names, k) for k in range(2, len(names) + 1))
        ):
            if root._get_slice_mesh_layout(dims).collapse() == flat._layout[0]:
                out[name] = dims
                break
        else:  # a flattened mesh is made from a slice of its root: never reached
            raise AssertionError(f"no axes of {names} flatten to mesh {name!r}")
    return out


def rebuild_in_place(root: DeviceMesh, ranks: torch.Tensor) -> None:
    """Lay ``root`` (a root mesh with axis names) out over ``ranks`` of the current default
    group, in place, with every flattened and sliced mesh of it that this process holds.
    ``ranks`` has ``root``'s number of axes. Every member of the new group calls it."""
    names = root.mesh_dim_names
    held, flattened = held_submeshes(root), dict(root._flatten_mapping)
    joined = flattened_axes(root)
    DeviceMesh.__init__(root, root.device_type, ranks, mesh_dim_names=names)
    for name in sorted(flattened):  # the same order on every rank: each makes a group
        new = root[joined[name]]._flatten(name)
        vars(flattened[name]).update(vars(new))
        root._flatten_mapping[name] = flattened[name]
    kept = {id(m) for m in flattened.values()}
    for mesh in held:
        if id(mesh) not in kept and mesh.mesh_dim_names:  # a slice of the root: named axes
            vars(mesh).update(vars(root[mesh.mesh_dim_names]))
