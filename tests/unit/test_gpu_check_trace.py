"""The GPU check's reading of a ``torch.profiler`` trace (``benchmarks/gpucheck/overlap.py``),
on a made-up trace with CUDA events: CI has no GPU, so this is where the device side of the
parser is checked before a GPU is lent (the dry run only has host ranges)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def analyse(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], dict[str, Any]]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from gpucheck.overlap import analyse

    return analyse


def _host(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "args": {}}


def _launch(corr: int, ts: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
            "args": {"correlation": corr}}  # fmt: skip


def _kernel(corr: int, name: str, stream: int, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream}}  # fmt: skip


def test_a_trace_with_cuda_events_is_read_per_step(analyse: Callable[..., Any]) -> None:
    # One step (microseconds): backward 100-600 on the host, three buckets launched before the
    # end-of-backward wait; the compute stream 7 runs 150-580; NCCL on stream 20 starts twice
    # during backward and once after it (ending at 620); a ZeRO-1 all-gather ends at 900, after
    # the host left opt.step() (650-750).
    events = [
        _host("ProfilerStep#3", 0, 1000), _host("gpu_check::backward", 100, 500),
        _host("gpu_check::optimizer", 650, 100), _host("gradsync::bucket_launch", 200, 5),
        _host("gradsync::bucket_launch", 300, 5), _host("gradsync::bucket_launch", 400, 5),
        _host("gradsync::bucket_wait", 550, 40),
    ]  # fmt: skip
    for corr, at in enumerate((110, 210, 310, 410, 220, 320, 560, 660), start=1):
        events.append(_launch(corr, at))
    events += [
        _kernel(1, "gemm", 7, 150, 100), _kernel(2, "gemm", 7, 260, 100),
        _kernel(3, "gemm", 7, 370, 100), _kernel(4, "gemm", 7, 480, 100),
        _kernel(5, "ncclDevKernel_AllReduce_Sum_f32", 20, 270, 50),
        _kernel(6, "ncclDevKernel_AllReduce_Sum_f32", 20, 380, 50),
        _kernel(7, "ncclDevKernel_AllReduce_Sum_f32", 20, 590, 30),
        _kernel(8, "ncclDevKernel_AllGather_RING_LL", 20, 700, 200),
    ]  # fmt: skip
    got = analyse({"traceEvents": events})
    assert got["buckets launched"] == 3
    assert got["launched before the end-of-backward wait"] == 3
    assert got["host: waiting for buckets (ms)"] == pytest.approx(0.04)
    assert got["GPU backward (ms)"] == pytest.approx(0.43)
    assert got["GPU communication ops"] == 4
    assert got["GPU communication started during backward"] == 2
    assert got["GPU communication (ms)"] == pytest.approx(0.33)
    assert got["GPU exposed communication (ms)"] == pytest.approx(0.32)  # to the gather's end
    assert got["host left opt.step() before its last gather ended"] == 1.0


def test_a_host_only_trace_has_no_device_rows(analyse: Callable[..., Any]) -> None:
    events = [_host("ProfilerStep#3", 0, 1000), _host("gpu_check::backward", 100, 500),
              _host("gradsync::bucket_launch", 200, 5), _host("gradsync::bucket_wait", 550, 40),
              _host("gradsync::bucket_launch", 560, 5)]  # fmt: skip
    got = analyse({"traceEvents": events})
    assert got == {"buckets launched": 2, "launched before the end-of-backward wait": 1,
                   "host: waiting for buckets (ms)": pytest.approx(0.04)}  # fmt: skip
