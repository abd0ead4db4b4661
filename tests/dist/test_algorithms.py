"""Ring and hierarchical all-reduce agree with the backend's own all-reduce on 1-5 gloo ranks.

Spawning costs seconds per rank on a small machine, so each world size is spawned once (lazily,
by the first test that needs it) and one rank function runs the whole grid, returning what the
tests below assert on.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradsync.comm import (
    ALGORITHMS,
    AllReduceAlgorithm,
    HierarchicalAllReduce,
    NativeAllReduce,
    RingAllReduce,
    get_algorithm,
)
from gradsync.comm.hierarchical import _group_timeout
from gradsync.comm.ring import chunk_bounds, segment_bounds
from gradsync.comm.worker import SerialWorker
from gradsync.testing.spawn import spawn

WORLD_SIZES = (1, 2, 3, 4, 5)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
# Integer-valued inputs stay below 41, so a sum over at most 6 ranks is at most 240: exact in
# every dtype tested, bfloat16 included (8 significant bits: integers up to 256 are exact). Then
# any summation order gives the same bits, and the results must equal native's exactly.
MODULUS = 41
SMALL_SEGMENT = 256
PG_TIMEOUT_S = 60.0


def _numels(world: int) -> list[int]:
    return sorted({0, 1, max(world - 1, 0), world + 1, 1000, 1003})


def _local_sizes(world: int) -> list[int]:
    return sorted({1, world} | ({2} if world % 2 == 0 else set()))


def _shape(numel: int) -> tuple[int, ...]:
    """Some shape per size: scalars, empty 2-D, 3-D, 2-D with a prime factor."""
    return {0: (0, 3), 1: (), 1000: (10, 10, 10), 1003: (17, 59)}.get(numel, (numel,))


def _make(kind: str, numel: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    if kind == "int":
        flat = torch.arange(numel) * (rank + 1) % MODULUS
    else:
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 16 + rank))
    return flat.to(dtype).reshape(_shape(numel))


def _tolerance(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Elementwise bound on |candidate - native| for random float inputs.

    Either algorithm adds the N inputs with at most N-1 roundings in some order, so each result
    is within (N-1)*u*S of the exact sum, S = sum over ranks of |x_r| and u = eps/2 the unit
    roundoff. Two such results differ by at most 2*(N-1)*u*S <= N*eps*S, and that is the
    tolerance (S computed exactly in float64). It holds for any summation order, so it does not
    depend on gloo's algorithm.
    """
    s = x.abs().to(torch.float64)
    dist.all_reduce(s, group=group)
    return world * torch.finfo(x.dtype).eps * s


def _compare(
    algos: dict[str, AllReduceAlgorithm],
    x: torch.Tensor,
    kind: str,
    group: dist.ProcessGroup | None = None,
) -> list[str]:
    """Run native once and each of ``algos`` on copies of ``x``; describe any mismatch."""
    expected = x.clone()
    NativeAllReduce().all_reduce(expected, group).wait()
    tol = None if kind == "int" else _tolerance(x, dist.get_world_size(group), group)
    failures = []
    for name, algo in algos.items():
        got = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)  # same layout
        algo.all_reduce(got, group).wait()
        what = f"{name} {kind} {x.dtype} shape={tuple(x.shape)} contig={x.is_contiguous()}"
        diff = (got.to(torch.float64) - expected.to(torch.float64)).abs()
        if got.dtype != x.dtype or got.shape != x.shape:
            failures.append(f"{what}: result has dtype {got.dtype}, shape {tuple(got.shape)}")
        elif tol is None and not torch.equal(got, expected):
            failures.append(f"{what}: not equal to native; max diff {diff.max().item()}")
        elif tol is not None and not bool((diff <= tol).all()):
            worst = f"{diff.max().item():.3g} (tolerance {tol.max().item():.3g})"
            failures.append(f"{what}: differs from native by up to {worst}")
    return failures


def _algorithms(world: int) -> dict[str, AllReduceAlgorithm]:
    """Every candidate. The small-segment ones split each chunk of a 1000-element tensor into
    more pipelined messages than there are receive buffers in flight; the hierarchical one only
    where a node size strictly between 1 and N exists (otherwise it would repeat the ring)."""
    algos: dict[str, AllReduceAlgorithm] = {
        "ring": RingAllReduce(),
        "ring(segment=256B)": RingAllReduce(segment_bytes=SMALL_SEGMENT),
    }
    if world > 2 and world % 2 == 0:
        algos["hierarchical(L=2, segment=256B)"] = HierarchicalAllReduce(
            2, segment_bytes=SMALL_SEGMENT
        )
    for local in _local_sizes(world):
        algos[f"hierarchical(L={local})"] = HierarchicalAllReduce(local_world_size=local)
    return algos


def _grid(rank: int, world: int) -> tuple[int, list[str]]:
    algos = _algorithms(world)
    failures: list[str] = []
    checked = 0
    seed = 0
    for numel in _numels(world):
        for dtype in DTYPES:
            for kind in ("int", "rand") if dtype.is_floating_point else ("int",):
                seed += 1
                x = _make(kind, numel, dtype, rank, seed)
                layouts = [x]
                if numel == 1003:  # a transposed (non-contiguous) view of the same values
                    layouts.append(x.reshape(59, 17).t())
                for tensor in layouts:
                    checked += len(algos)
                    failures += [f"rank {rank}: {f}" for f in _compare(algos, tensor, kind)]
    return checked, failures


def _back_to_back(rank: int, world: int) -> list[str]:
    """Several all-reduces queued before any wait, then waited in reverse order, per algorithm."""
    specs = [
        (1003, torch.float32),
        (5, torch.float64),
        (0, torch.float32),
        (1000, torch.bfloat16),
        (1, torch.int64),
        (2000, torch.float32),
        (world + 1, torch.float64),
    ]
    algos = list(_algorithms(world).values())
    inputs = [_make("int", n, dt, rank, 0) for n, dt in specs]
    expected = [x.clone() for x in inputs]
    for t in expected:
        NativeAllReduce().all_reduce(t).wait()
    failures = []
    for algo in algos:
        outs = [x.clone() for x in inputs]
        handles = [algo.all_reduce(t) for t in outs]
        for h in reversed(handles):
            h.wait()
        for i, (got, want) in enumerate(zip(outs, expected, strict=True)):
            if not torch.equal(got, want):
                failures.append(f"rank {rank}: {algo.name} back-to-back call {i} {specs[i]} wrong")
    return failures


def _byte_counts(rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """(bytes_sent, bytes_received, calls) of one 1003-element float32 all-reduce."""
    counts = {}
    local = 2 if world % 2 == 0 else world
    algos: list[AllReduceAlgorithm] = [RingAllReduce(), HierarchicalAllReduce(local)]
    for algo in algos:
        algo.all_reduce(torch.ones(1003)).wait()
        counts[algo.name] = (algo.stats.bytes_sent, algo.stats.bytes_received, algo.stats.calls)
    return counts


def _misuse(rank: int, world: int) -> dict[str, str]:
    """Messages of the ValueErrors users can trigger; raised before any communication."""
    out = {}
    for key, call in {
        "indivisible": lambda: HierarchicalAllReduce(world + 1).all_reduce(torch.ones(3)),
    }.items():
        try:
            call()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    return out


def _env(rank: int, world: int) -> dict[str, object]:
    """``local_world_size`` from torchrun's LOCAL_WORLD_SIZE, or one node when it is unset."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from_env = HierarchicalAllReduce()
    del os.environ["LOCAL_WORLD_SIZE"]
    x = _make("int", 1003, torch.float32, rank, 0)
    two_nodes = HierarchicalAllReduce(local_world_size=2)
    two_nodes.all_reduce(torch.ones(3)).wait()
    plan = two_nodes._plans[dist.group.WORLD]
    return {
        "subgroup_timeouts": [_group_timeout(g) for g in (plan.node.group, plan.cross.group)],
        "from_env": from_env.local_world_size,
        "env_unset": HierarchicalAllReduce().local_world_size,
        "env_result": _compare({"env": from_env}, x, "int"),
    }


def _non_default_parent(rank: int, world: int) -> dict[str, object]:
    """All ranks but 0 form the parent group: its subgroups are created without rank 0."""
    out: dict[str, object] = {}
    parent = dist.new_group(list(range(1, world)))
    failures = []
    if rank != 0:
        algos = {"ring": RingAllReduce(), "hierarchical": HierarchicalAllReduce(2)}
        for n in (1003, 3):
            x = _make("int", n, torch.float32, rank, 0)
            failures += [
                f"rank {rank}: parent group: {f}" for f in _compare(algos, x, "int", parent)
            ]
    out["subgroup_failures"] = failures
    dist.barrier()
    return out


def _suite(rank: int, world: int) -> dict[str, object]:
    start = time.perf_counter()
    checked, failures = _grid(rank, world)
    result: dict[str, object] = {
        "checked": checked,
        "grid_failures": failures,
        "back_to_back_failures": _back_to_back(rank, world),
        "bytes": _byte_counts(rank, world),
        "misuse": _misuse(rank, world),
    }
    if world == 4:
        result.update(_env(rank, world))
    if world == 5:
        result.update(_non_default_parent(rank, world))
    result["seconds"] = time.perf_counter() - start
    return result


@functools.cache
def _results(world: int) -> list[dict]:
    return spawn(_suite, world, pg_timeout_s=PG_TIMEOUT_S, timeout_s=240.0)


# ---------------------------------------------------------------- multi-rank (one spawn per N)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_grid_matches_native(world: int) -> None:
    results = _results(world)
    assert all(r["checked"] > 0 for r in results)
    failures = [f for r in results for f in r["grid_failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:10])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_back_to_back_calls_before_wait(world: int) -> None:
    failures = [f for r in _results(world) for f in r["back_to_back_failures"]]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", (2, 3, 4))
def test_ring_sends_two_n_minus_one_over_n_of_the_tensor(world: int) -> None:
    nbytes = 1003 * 4
    one_chunk = -(-1003 // world) * 4
    ideal = 2 * (world - 1) / world * nbytes
    for rank, r in enumerate(_results(world)):
        for name in ("ring", "hierarchical"):
            sent, received, calls = r["bytes"][name]
            assert calls == 1
            assert abs(sent - ideal) <= one_chunk, (name, rank, sent, ideal)
            assert abs(received - ideal) <= one_chunk, (name, rank, received, ideal)
    for name in ("ring", "hierarchical"):
        sent_total = sum(r["bytes"][name][0] for r in _results(world))
        received_total = sum(r["bytes"][name][1] for r in _results(world))
        assert sent_total == received_total, name  # every byte sent is received somewhere


@pytest.mark.timeout(300)
def test_user_errors_are_value_errors() -> None:
    for rank, misuse in enumerate(_results(4)):
        msg = misuse["misuse"]["indivisible"]
        assert "world size 4" in msg and "local_world_size 5" in msg, (rank, msg)


@pytest.mark.timeout(300)
def test_local_world_size_from_env_and_subgroup_timeout() -> None:
    for r in _results(4):
        # new_group would default to 30 minutes; the subgroups get the parent's timeout.
        assert r["subgroup_timeouts"] == [timedelta(seconds=PG_TIMEOUT_S)] * 2
        assert r["from_env"] == 2
        assert r["env_unset"] is None
        assert r["env_result"] == []


@pytest.mark.timeout(300)
def test_parent_group_other_than_the_default() -> None:
    results = _results(5)
    failures = [f for r in results for f in r["subgroup_failures"]]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- single process, no spawn


def test_chunk_bounds_cover_the_range_evenly() -> None:
    for parts in range(1, 8):
        for numel in range(0, 30):
            bounds = chunk_bounds(numel, parts)
            assert len(bounds) == parts
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # chunk 0 is a largest one
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match="parts"):
        chunk_bounds(5, 0)


def test_segment_bounds() -> None:
    assert segment_bounds(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert segment_bounds(4, 4, 3) == []
    with pytest.raises(ValueError, match="segment"):
        segment_bounds(0, 4, 0)


@pytest.mark.timeout(30)
def test_serial_worker_runs_in_order_and_reraises() -> None:
    worker = SerialWorker("test-worker")
    order: list[int] = []
    gate = threading.Event()

    def job(i: int) -> None:
        if i == 0:
            gate.wait(5)  # later jobs queue up behind a slow first one
        order.append(i)

    handles = [worker.submit(functools.partial(job, i)) for i in range(5)]
    with pytest.raises(RuntimeError, match="did not complete within"):
        handles[0].wait(timeout=timedelta(milliseconds=50))  # the job itself keeps going
    gate.set()
    for h in reversed(handles):
        assert h.wait() is True
    assert order == [0, 1, 2, 3, 4]

    def boom() -> None:
        raise KeyError("worker failure")

    failed = worker.submit(boom)
    after = worker.submit(lambda: None)
    with pytest.raises(KeyError, match="worker failure"):
        failed.wait()
    with pytest.raises(RuntimeError, match="earlier all-reduce failed"):
        after.wait()
    worker.close()


@pytest.mark.timeout(30)
def test_a_failed_worker_ends_its_thread_and_lets_its_owner_go() -> None:
    # A wrapper rebuilt after a lost rank drops its old algorithm; the failure's traceback
    # refers to that algorithm, so a thread that kept the failure would keep it alive for good.
    class Owner:
        def __init__(self) -> None:
            self.worker = SerialWorker("gradsync-test-failing")

        def job(self) -> None:
            raise ConnectionError("a peer is gone")

    owner = Owner()
    with pytest.raises(ConnectionError):
        owner.worker.submit(owner.job).wait()
    for thread in threading.enumerate():
        if thread.name == "gradsync-test-failing":
            thread.join(timeout=5.0)
    assert not [t for t in threading.enumerate() if t.name == "gradsync-test-failing"]
    with pytest.raises(RuntimeError, match="earlier all-reduce failed"):
        owner.worker.submit(lambda: None).wait(timeout=timedelta(seconds=5))
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None


def test_registry() -> None:
    assert {"native", "ring", "hierarchical"} <= set(ALGORITHMS)
    assert isinstance(get_algorithm("ring"), RingAllReduce)
    assert isinstance(get_algorithm("hierarchical"), HierarchicalAllReduce)
    with pytest.raises(ValueError, match="local_world_size"):
        HierarchicalAllReduce(local_world_size=0)
