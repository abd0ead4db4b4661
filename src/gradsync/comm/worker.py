"""A single background thread that runs collective jobs one at a time, in submission order.

The ring and hierarchical algorithms are built from point-to-point sends; running them on one
worker thread per algorithm instance is what makes them asynchronous (``all_reduce`` returns a
handle at once, as ``dist.all_reduce(async_op=True)`` does) while keeping the messages of
successive all-reduces from interleaving.

[Note: the caller's stream]
CUDA's current stream (and current device) is per thread, and a fresh thread's is the default
stream of device 0. A job that simply ran there would neither wait for the kernels the caller
queued before submitting it (the copy of gradients into the bucket, on the backward's stream)
nor make the caller's later kernels wait for it, and it might run on another GPU. A job that ran
on the caller's stream itself would be ordered, but a blocking collective in it makes that
stream wait for the wire, so the rest of the backward, queued on the same stream, would wait
too: no overlap. So each worker has a side stream on the caller's device, as torch's NCCL
process group has its own: at submission an event on the caller's stream marks what the job
must wait for, the side stream waits for it, the job runs there, and an event recorded after it
is what ``wait()`` makes the caller's stream wait for, as torch makes it wait on a comm hook's
future. A job handed on from one worker to another is submitted from the first worker's thread,
where the side stream is current: the second half queues behind the first.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


class AsyncHandle:
    """Completion of one job on a :class:`SerialWorker`; ``wait()`` re-raises the job's error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._after: Any = None  # CUDA: an event recorded after the job's kernels

    def _finish(self, error: BaseException | None, after: Any = None) -> None:
        self._error, self._after = error, after
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; ``RuntimeError`` if that takes longer than ``timeout``, like
        ``dist.Work.wait``. A timed-out job keeps running, so a later ``wait`` may succeed."""
        seconds = None if timeout is None else max(timeout.total_seconds(), 0.0)
        if not self._done.wait(seconds):
            raise RuntimeError(f"all-reduce did not complete within {timeout}")
        if self._error is not None:
            raise self._error
        if self._after is not None:  # the waiting thread's stream waits for the job's kernels
            torch.cuda.current_stream().wait_event(self._after)
        return True


class ChainedHandle:
    """Completion of a job whose first half runs on one :class:`SerialWorker` and hands its
    second half to another (``second``, set by the first half before it returns), so that the
    first worker can start the next job while the second half of this one waits.
    ``wait(timeout)`` covers both halves within ``timeout``."""

    def __init__(self) -> None:
        self.first: AsyncHandle | None = None
        self.second: AsyncHandle | None = None

    def is_completed(self) -> bool:
        return self.second is not None and self.second.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert self.first is not None
        start = time.monotonic()
        self.first.wait(timeout)
        assert self.second is not None, "the first half returned without handing on"
        if timeout is not None:
            timeout = max(timeout - timedelta(seconds=time.monotonic() - start), timedelta(0))
        return self.second.wait(timeout)


class SerialWorker:
    """One daemon thread running submitted jobs one at a time, in submission order.

    A single thread per algorithm instance is what keeps messages of successive all-reduces from
    interleaving: every rank runs the same sequence of jobs, each to completion. After a job fails
    its peers may be left mid-ring, so later jobs fail at once instead of talking to them.

    The thread never outlives its use. It holds the :class:`_Lane` (queue, failure, side
    streams), not this object, so an algorithm or wire dropped without :meth:`close` (the
    wrapper that owned it went out of scope, or was rebuilt after a lost rank) is collected,
    and its finalizer tells the thread to stop once the jobs already queued are done; after a
    failure the thread ends at once. A thread that held its owner would keep it alive, and the
    process groups it talks on, for the life of the process: one more for every wrapper built.
    """

    def __init__(self, name: str) -> None:
        self._lane = _Lane(name)
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._lane.queue.put, None)

    def submit(self, job: Callable[[], None]) -> AsyncHandle:
        handle, lane = AsyncHandle(), self._lane
        with lane.lock:
            if lane.failure is not None:
                handle._finish(lane.failed())
                return handle
            if self._thread is None:
                self._thread = threading.Thread(target=lane.run, name=lane.name, daemon=True)
                self._thread.start()
            lane.queue.put((job, handle, _mark_callers_stream()))
        return handle

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (a later ``submit`` starts a new one)."""
        with self._lane.lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._lane.queue.put(None)
        if thread is not None:
            thread.join()


class _Lane:
    """What a :class:`SerialWorker`'s thread works with: its queue of jobs (``None``: stop), the
    first failure (after which every job fails at once), its side stream on each CUDA device."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue[tuple[Callable[[], None], AsyncHandle, Any] | None] = (
            queue.SimpleQueue()
        )
        self.lock = threading.Lock()  # orders a failure against submits
        self.failure: BaseException | None = None
        self.side: dict[Any, Any] = {}  # CUDA device -> this worker's stream there

    def failed(self) -> RuntimeError:
        err = RuntimeError(f"{self.name}: an earlier all-reduce failed")
        err.__cause__ = self.failure
        return err

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, handle, ready = item
            del item  # between jobs the thread holds nothing of its owner (see SerialWorker)
            try:
                after = None
                if ready is None:
                    job()
                else:
                    after = self._run_on_side_stream(job, *ready)
            except BaseException as exc:  # handed to wait(), which re-raises it in the caller
                with self.lock:  # a submit from now on fails at once; earlier ones are queued
                    self.failure = exc
                handle._finish(exc)
                self._fail_queued()
                return  # the failure's traceback holds the owner: this thread must not
            handle._finish(None, after)
            del job, handle, ready

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1]._finish(self.failed())

    def _run_on_side_stream(self, job: Callable[[], None], ready: Any, device: Any) -> Any:
        """Run ``job`` on this worker's stream on ``device`` after the caller's ``ready``
        event; return an event recorded after its kernels (see [Note: the caller's stream])."""
        side = self.side.get(device)
        if side is None:
            side = self.side[device] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            job()
            after = torch.cuda.Event()
            after.record(side)
        return after


def _mark_callers_stream() -> tuple[Any, Any] | None:
    """An event recorded now on this thread's current CUDA stream, and that stream's device;
    ``None`` where CUDA is not in use (see [Note: the caller's stream])."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    stream, ready = torch.cuda.current_stream(), torch.cuda.Event()
    ready.record(stream)
    return ready, stream.device
