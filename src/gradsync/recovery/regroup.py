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
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

# The groups of earlier generations, kept alive: see close_groups.
_retired: list[dist.ProcessGroup] = []


def close_groups(close: Sequence[dist.ProcessGroup] = ()) -> str:
    """Tear down every process group of this process (aborting NCCL communicators first, which
    would otherwise wait on the dead); returns the default group's backend.

    A gloo group's destructor joins its worker threads, and a thread may still be inside a
    collective that a live peer left (its own destructor waiting on the same): destroyed now,
    the two would wait on each other until the group's timeout. Kept referenced here, the
    groups are only unregistered; their threads end with that timeout, in the background.
    The groups in ``close`` are destroyed instead, on a thread of their own: groups whose
    members all live (a mesh replica's own, [Note: a mesh under Recovery]), where a peer
    waiting in one of their collectives for this rank must see its connections close."""
    backend = str(dist.get_backend())
    groups = list(dist.distributed_c10d._world.pg_map)
    if backend == "nccl":
        for group in groups:
            dist.distributed_c10d._abort_process_group(group)
    closing = {id(g) for g in close}
    _retired.extend(g for g in groups if id(g) not in closing)
    dist.destroy_process_group()
    if closing:
        _destroy_in_background([g for g in groups if id(g) in closing])
    return backend


def _destroy_in_background(groups: list[dist.ProcessGroup]) -> None:
    """Drop ``groups`` on a thread that waits to hold their last references (the caller's go
    when it returns), so that their destructors, which close the connections and may wait for
    a worker thread, run there and not in the training loop."""

    def destroy() -> None:
        give_up = time.monotonic() + 60.0
        while time.monotonic() < give_up and any(sys.getrefcount(g) > _HELD for g in groups):
            time.sleep(0.005)
        groups.clear()

    threading.Thread(target=destroy, name="gradsync-close-groups", daemon=True).start()


# sys.getrefcount of a group held only by destroy()'s list: the list, the generator's
# variable and the call's argument
_HELD = 3


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
