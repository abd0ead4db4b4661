"""``benchmarks/straggler_cost.py``'s in-process micro-benchmark drives the step timeline's
parts directly (the recorder, bucket 0's tail, ``attribute``), so it breaks when their API
changes, and no other test runs it. Here it runs once, with the fewest repetitions."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def straggler_cost(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    log = logging.getLogger("gradsync.stragglers")
    saved = log.level, log.propagate, list(log.handlers)
    import straggler_cost

    yield straggler_cost
    log.setLevel(saved[0])  # micro() quiets this logger for the whole process
    log.propagate = saved[1]
    log.handlers[:] = saved[2]


def test_the_micro_benchmark_times_every_part(straggler_cost: Any) -> None:
    rows = straggler_cost.micro(num_buckets=2, every=10, repeats=1)
    names = [name for name, *_ in rows]
    assert len(names) == 10, names
    assert names[-1] == "all of it: a step of StepTimeline, report every 10 (world 64)"
    assert all(median > 0 and best > 0 for _, median, best, _ in rows), rows
