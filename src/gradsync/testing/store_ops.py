"""A job's store on loopback whose every operation is counted, for the recovery-at-scale checks.

The ranks of ``spawn.py`` meet through a ``file://`` store; a torchrun job's store is a
TCPStore that global rank 0's process hosts. :func:`tcp_world` moves a spawned rank onto the
latter (rank 0 hosts it on 127.0.0.1), wrapped in a :class:`CountingStore`, so that a check
can say how many store operations, keys and bytes a survivor spent in each phase of a
recovery: torch's process groups go through the same wrapper (a ``PrefixStore`` over it) and
are counted too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Op:
    """One store operation: when it began (``time.time()``), what it was, how many keys it
    named and how many value bytes it carried either way, and whether the main thread made it."""

    at: float
    name: str
    key: str  # the first key named
    keys: int
    nbytes: int
    main: bool


def _size(value: object) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return 8  # a counter


class CountingStore(dist.Store):
    """Forwards every call to ``inner`` and records it in :attr:`ops` (shared with clones)."""

    def __init__(self, inner: dist.Store, ops: list[Op] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.ops: list[Op] = [] if ops is None else ops
        self._clones: list[CountingStore] = []  # torch keeps only the C++ half of a clone

    def _record(self, name: str, key: str | list[str], *values: object) -> None:
        main = threading.current_thread() is threading.main_thread()
        keys = [key] if isinstance(key, str) else key
        first = keys[0] if keys else ""
        self.ops.append(Op(time.time(), name, first, len(keys), sum(map(_size, values)), main))

    def set(self, key: str, value: str) -> None:
        self._record("set", key, value)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        out = self.inner.get(key)
        self._record("get", key, out)
        return out

    def add(self, key: str, value: int) -> int:
        self._record("add", key)
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        out = self.inner.compare_set(key, expected, desired)
        self._record("compare_set", key, expected, desired, out)
        return out

    def append(self, key: str, value: object) -> None:
        self._record("append", key, value)
        self.inner.append(key, value)  # type: ignore[attr-defined]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = self.inner.multi_get(keys)
        self._record("multi_get", keys, out)
        return out

    def multi_set(self, keys: list[str], values: list[object]) -> None:
        self._record("multi_set", keys, values)
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._record("wait", keys)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._record("check", keys)
        return self.inner.check(keys)

    def num_keys(self) -> int:
        self._record("num_keys", [])
        return self.inner.num_keys()

    def delete_key(self, key: str) -> bool:
        self._record("delete_key", key)
        return self.inner.delete_key(key)

    def clone(self) -> CountingStore:
        twin = CountingStore(self.inner.clone(), self.ops)  # type: ignore[attr-defined]
        self._clones.append(twin)
        return twin


def tcp_world(rank: int, world_size: int, timeout_s: float = 60.0) -> CountingStore:
    """Leave the ``file://`` group of a spawned rank for one over a TCPStore on 127.0.0.1 that
    rank 0's process hosts, as torchrun's store with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
    returns the counting store the new default group (and a ``Recovery``) uses."""
    timeout = timedelta(seconds=timeout_s)
    server = None
    if rank == 0:
        server = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
    port = [server.port if server is not None else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    inner = server or dist.TCPStore("127.0.0.1", port[0], is_master=False, timeout=timeout)
    store = CountingStore(inner)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    return store


def ops_between(ops: list[Op], start: float, end: float, main: bool = True) -> list[Op]:
    """The operations begun in ``[start, end)`` (by the main thread, or by the others)."""
    return [op for op in ops if start <= op.at < end and op.main == main]


def gradsyncs(ops: list[Op]) -> list[Op]:
    """Those of gradsync's own keys (recovery, arrival records), not torch's group set-up."""
    return [op for op in ops if "gradsync/recovery/" in op.key or "gradsync/last_seen/" in op.key]
