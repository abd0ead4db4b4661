"""Collectives: all-reduce algorithms behind one interface, and the bucket communication seam."""

from __future__ import annotations

from gradsync.comm.algorithm import AllReduceAlgorithm, CommStats, Handle, NativeAllReduce
from gradsync.comm.compress import HalfPrecisionHook
from gradsync.comm.formats import describe_compression, make_comm_hook
from gradsync.comm.hierarchical import HierarchicalAllReduce
from gradsync.comm.hook import AllReduceHook, BucketLike, CommHook
from gradsync.comm.powersgd import PowerSGD, PowerSGDHook
from gradsync.comm.ring import RingAllReduce

ALGORITHMS: dict[str, type[AllReduceAlgorithm]] = {
    "native": NativeAllReduce,
    "ring": RingAllReduce,
    "hierarchical": HierarchicalAllReduce,
}


def get_algorithm(algorithm: str | AllReduceAlgorithm) -> AllReduceAlgorithm:
    """An algorithm instance from its name (``"native"``, ...) or the instance itself."""
    if isinstance(algorithm, AllReduceAlgorithm):
        return algorithm
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}"
        ) from None


__all__ = [
    "ALGORITHMS",
    "AllReduceAlgorithm",
    "AllReduceHook",
    "BucketLike",
    "CommHook",
    "CommStats",
    "Handle",
    "HalfPrecisionHook",
    "HierarchicalAllReduce",
    "NativeAllReduce",
    "PowerSGD",
    "PowerSGDHook",
    "RingAllReduce",
    "describe_compression",
    "get_algorithm",
    "make_comm_hook",
]
