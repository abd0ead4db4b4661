"""Jobs on gradsync's worker threads run under the submitting thread's CUDA stream ([Note: the
caller's stream] in ``comm/worker.py``). Without a GPU, ``torch.cuda``'s stream functions are
replaced by a per-thread stand-in that behaves as CUDA's does: a fresh thread starts on the
default stream of device 0."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gradsync.comm.worker import AsyncHandle, SerialWorker


def test_a_job_runs_on_the_stream_current_where_it_was_submitted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    current = threading.local()

    @contextmanager
    def stream(s: str) -> Iterator[None]:
        previous = getattr(current, "stream", None)
        current.stream = s
        try:
            yield
        finally:
            current.stream = previous

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device=None: getattr(current, "stream", "cuda:0 default"),
    )
    monkeypatch.setattr(torch.cuda, "stream", stream)

    seen: list[str] = []
    handed_on: list[AsyncHandle] = []
    first, second = SerialWorker("first"), SerialWorker("second")

    def hand_on() -> None:  # a job that submits its second half to another worker
        handed_on.append(second.submit(lambda: seen.append(torch.cuda.current_stream())))

    current.stream = "the backward's stream on cuda:1"
    first.submit(lambda: seen.append(torch.cuda.current_stream())).wait()
    first.submit(hand_on).wait()
    handed_on[0].wait()
    assert seen == ["the backward's stream on cuda:1"] * 2
    first.close()
    second.close()
