"""``gradsync bench --trace`` end to end with a tiny model: one Chrome/Perfetto trace per rank,
each with gradsync's five ranges in it, and a table per rank on stdout.

Run as a subprocess, as a user runs it; the times in the table mean nothing here and are not
checked, only that every range was recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RANGES = [
    "gradsync::bucket_copy_in",
    "gradsync::bucket_launch",
    "gradsync::bucket_wait",
    "gradsync::step_checks",
    "gradsync::bucket_write_back",
]


@pytest.mark.timeout(180)
def test_bench_trace_writes_a_trace_per_rank_with_every_range(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    cmd = [
        sys.executable, "-m", "gradsync", "bench", "--trace", "--out", str(out),
        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--trace-steps", "2",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    traces = [out / f"trace-rank{rank}.json" for rank in range(2)]
    events = []
    for path in traces:
        assert str(path) in proc.stdout, proc.stdout
        trace = json.loads(path.read_text())
        assert isinstance(trace["traceEvents"], list) and trace["traceEvents"], path
        events.append(trace["traceEvents"])
    names = {e.get("name") for e in events[0]}
    assert set(RANGES) <= names, sorted(n for n in names if str(n).startswith("gradsync"))
    # The table: every range and the steps' total, for both ranks.
    for name in [*RANGES, "ProfilerStep#* (whole steps)"]:
        assert proc.stdout.count(f"| {name} |") == 2, proc.stdout
