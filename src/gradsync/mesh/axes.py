"""The data-parallel ranks of a device mesh: the axes whose ranks saw different data.

[Note: which mesh axes are summed]
In a (dp, cp, tp) mesh the ranks along ``dp`` hold replicas fed different samples and the ranks
along ``cp`` hold different chunks of the same sequences: both computed *parts* of the one
gradient that single-process training would compute, so gradients are summed (or averaged)
over the ranks of both axes together. The ranks along ``tp`` computed the *same* part of the
batch, each for its own shard of the weights (or, for a replicated weight, the same gradient):
summing over them would count every sample ``tp`` times, or mix unrelated shards. So the user
names the data-parallel sub-mesh (``mesh["dp"]`` or ``mesh["dp", "cp"]``) and gradsync reduces
over exactly its ranks, as one flat group: one collective per bucket, the same number as over a
flat group of that size. A parameter that is *sharded* along an axis inside that sub-mesh is
refused (``dtensors.check_data_parallel_placements``): its values differ across ranks that
gradsync would average.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gradsync.errors import UsageError


def data_parallel_group(
    process_group: dist.ProcessGroup | None, device_mesh: DeviceMesh | None
) -> dist.ProcessGroup | None:
    """The process group gradients are reduced over: ``process_group``, or the ranks of
    ``device_mesh`` (all its axes flattened into one), or ``None`` for the world.

    Called by every rank of the job: flattening a sub-mesh creates its group collectively.
    """
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise UsageError(
            "pass either process_group or device_mesh, not both: device_mesh names the "
            "data-parallel ranks itself"
        )
    if not isinstance(device_mesh, DeviceMesh):
        raise UsageError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. "
            f"mesh['dp'] or mesh['dp', 'cp']), got {type(device_mesh).__name__}"
        )
    if device_mesh.ndim == 1:
        return device_mesh.get_group()
    # torch has no public flatten yet; torchtitan uses the same private method for its
    # (dp, cp) loss mesh. It caches the flattened mesh on the root, so re-wrapping is cheap.
    return device_mesh._flatten().get_group()


def axis_names(device_mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The axis names of the data-parallel mesh, for settings and messages."""
    if device_mesh is None or device_mesh.mesh_dim_names is None:
        return ()
    return tuple(device_mesh.mesh_dim_names)
