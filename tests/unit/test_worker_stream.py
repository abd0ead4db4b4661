"""Jobs on gradsync's worker threads are ordered with the caller's CUDA stream without running
on it ([Note: the caller's stream] in ``comm/worker.py``). Without a GPU, ``torch.cuda``'s
streams and events are replaced by stand-ins that log what they are asked to do and keep a
current stream per thread, as CUDA does (a fresh thread starts on device 0's default stream).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradsync.comm.worker import AsyncHandle, SerialWorker


class FakeStream:
    def __init__(self, name: str, device: str, log: list[str]) -> None:
        self.name, self.device, self.log = name, device, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


class FakeEvent:
    def __init__(self) -> None:
        self.name = "an unrecorded event"

    def record(self, stream: FakeStream) -> None:
        self.name = f"the mark on {stream.name}"
        stream.log.append(f"mark {stream.name}")


def _fake_cuda(monkeypatch: Any, log: list[str]) -> threading.local:
    current = threading.local()
    default = FakeStream("cuda:0's default stream", "cuda:0", log)

    @contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        previous = getattr(current, "stream", default)
        current.stream = s
        try:
            yield
        finally:
            current.stream = previous

    def side_stream(device: str) -> FakeStream:
        return FakeStream(f"a side stream on {device}", device, log)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: getattr(current, "stream", default))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Stream", side_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return current


def test_a_job_waits_for_the_callers_stream_runs_beside_it_and_is_waited_for(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    log: list[str] = []
    current = _fake_cuda(monkeypatch, log)
    current.stream = FakeStream("the backward's stream", "cuda:1", log)
    worker = SerialWorker("test")

    def job() -> None:
        log.append(f"job on {torch.cuda.current_stream().name}")

    worker.submit(job).wait()
    assert log == [
        "mark the backward's stream",  # what the job must come after (the bucket's copy-in)
        "a side stream on cuda:1 waits for the mark on the backward's stream",
        "job on a side stream on cuda:1",  # not on the backward's stream: it keeps computing
        "mark a side stream on cuda:1",
        "the backward's stream waits for the mark on a side stream on cuda:1",  # in wait()
    ]
    worker.close()


def test_a_job_handed_on_queues_behind_the_first_half(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    log: list[str] = []
    current = _fake_cuda(monkeypatch, log)
    current.stream = FakeStream("the backward's stream", "cuda:1", log)
    first, second = SerialWorker("first"), SerialWorker("second")
    handed_on: list[AsyncHandle] = []

    def hand_on() -> None:
        handed_on.append(second.submit(lambda: log.append("second half")))

    first.submit(hand_on).wait()
    handed_on[0].wait()
    assert "a side stream on cuda:1 waits for the mark on a side stream on cuda:1" in log
    assert "second half" in log and "cuda:0" not in " ".join(log)
    first.close()
    second.close()
