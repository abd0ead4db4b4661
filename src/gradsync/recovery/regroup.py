"""New process groups for the survivors, in the same processes.

[Note: regrouping without a restart]
torch 2.13 has no way to take a dead rank out of a gloo group: ``dist.shrink_group`` raises
on gloo (on NCCL >= 2.27 it uses ``ncclCommShrink``), and c10d's ``reconfigure`` (grow, shrink,
ranks assigned through the store) is expected in torch 2.14. What works on every backend is
what the restart path does, minus the restart: tear the groups down and initialise a new
default group over the same store, under a prefix of its own for each generation (so that no
key of an earlier generation, whose members differ, is read again). The survivors keep their
processes, their imported torch, their model and optimizer in memory; only the connections are
new. :func:`regroup` is the one place to swap for ``reconfigure`` once torch has it.

Destroying the old groups first matters for more than tidiness: a survivor still blocked in a
collective with this one (it had not noticed the loss yet) sees its connections close and
raises at once, instead of waiting for the group's timeout.

Every group goes: the default one, gradsync's private ones, and the user's own. The user's
collectives outside gradsync are the user's to re-create over the new default group.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

# The groups of earlier generations, kept alive: see close_groups.
_retired: list[dist.ProcessGroup] = []


def close_groups() -> str:
    """Tear down every process group of this process (aborting NCCL communicators first, which
    would otherwise wait on the dead); returns the default group's backend.

    A gloo group's destructor joins its worker threads, and a thread may still be inside a
    collective that a live peer left (its own destructor waiting on the same): destroyed now,
    the two would wait on each other until the group's timeout. Kept referenced here, the
    groups are only unregistered; their threads end with that timeout, in the background."""
    backend = str(dist.get_backend())
    groups = list(dist.distributed_c10d._world.pg_map)
    if backend == "nccl":
        for group in groups:
            dist.distributed_c10d._abort_process_group(group)
    _retired.extend(groups)
    dist.destroy_process_group()
    return backend


def job_store(join: str | None) -> tuple[dist.Store, str | None]:
    """The store every member, and a replacement, can reach, and its ``host:port`` if it has
    one: the store at ``join`` (a replacement's), else under torchrun a client of the workers'
    store (``MASTER_ADDR``, ``MASTER_PORT``), else the default group's: a ``TCPStore`` (any
    launcher's ``env://`` or ``tcp://``, or one passed as ``store=``) has an address a
    replacement can join at; a ``file://`` store has none."""
    address = join
    if address is None and "TORCHELASTIC_RUN_ID" in os.environ:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if address is None:
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):  # the keys as a replacement's client sees them
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            return store, f"{store.host}:{store.port}"
        return store, None
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60)), address


def regroup(
    store: dist.Store, generation: str, rank: int, world_size: int, backend: str, timeout: timedelta
) -> None:
    """Initialise the default group of ``generation`` (a name no other generation of the job
    has): ``world_size`` members over ``store``, this process as ``rank``. Every member calls
    it; it returns once all have connected."""
    prefix = dist.PrefixStore(f"gradsync/generation/{generation}/", store)
    dist.init_process_group(
        backend, store=prefix, rank=rank, world_size=world_size, timeout=timeout
    )
