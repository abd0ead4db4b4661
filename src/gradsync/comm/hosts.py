"""Which ranks of a group share a host: what the default bucket plan reads
([Note: the default bucket cap] in ``ddp/plan.py``).

Two ranks share a host when their traffic need not cross a network link: the same running
machine (its boot id) and the same network namespace. Ranks in containers or namespaces of
their own count as hosts of their own, as the simulated cluster's nodes do, because their
traffic goes through a network interface, however fast; that errs towards the plan made for
slower links. torchrun's ``LOCAL_WORLD_SIZE`` would say the same for a whole job, but not for
a subgroup (a device mesh's data-parallel axis), and not for ranks started some other way.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gradsync.failfast.deadline import Deadline


def host_key() -> str:
    """This process's host: boot id and network namespace where ``/proc`` has them (Linux),
    else the host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return f"host:{socket.gethostname()}"


def count_hosts(deadline: Deadline) -> int:
    """How many hosts the ranks of ``deadline``'s group are on: one gather, under the deadline,
    so every rank counts the same."""
    return len(set(deadline.gather_objects(host_key(), "the hosts of the group's ranks")))
