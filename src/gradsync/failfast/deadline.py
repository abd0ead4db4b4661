"""Deadlines for gradsync's own collectives: a missing rank becomes an error that names it.

Torch's default process-group timeout is 30 minutes and its message names no cause. Every
collective gradsync issues goes through a :class:`Deadline`: it is started asynchronously and
waited for with the wrapper's own ``timeout=`` (minutes by default, seconds in tests). On expiry
every waiting rank raises :class:`CollectiveTimeoutError` naming the operation, the step, the
ranks that did not arrive and where they were last seen (``arrivals.py``), and, when a peer
was lost inside the collective, which rank died (a roll call, ``liveness.py``).

After such a failure the group may hold a half-finished collective, which would pair with a
late rank's next one (mixing unrelated tensors) and keeps the process from exiting until the
group's own timeout. So the deadline then refuses every further collective with an error that
says why, and releases the group (:func:`~gradsync.failfast.group.release_group`) so that the
process can end.
"""

from __future__ import annotations

import math
import pickle
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.errors import CollectiveTimeoutError, ProtocolError, UsageError, first_line
from gradsync.failfast.arrivals import ArrivalRecords
from gradsync.failfast.group import private_group, release_group
from gradsync.mesh.dtensors import local


class Handle(Protocol):
    """An operation in flight (a collective, a bucket's communication): ``wait()`` blocks until
    its result is in place; ``wait(timeout)`` raises ``RuntimeError`` if it is not there within
    ``timeout``, as ``dist.Work.wait`` does. Deadlines are built on that."""

    def wait(self, timeout: timedelta | None = None) -> object: ...


class DeviceEvent(Protocol):
    """What :meth:`Deadline.wait_device` polls: a ``torch.cuda.Event``."""

    def query(self) -> bool: ...


_ROLL_CALL_S = 2.0  # the longest a failed rank waits for its peers' answers (liveness.py)
_SLICE_S = 0.05  # while a regroup may begin: how often a waiting rank looks for one


class RegroupWatch(Protocol):
    """What in-process recovery (``gradsync.recovery``) gives every deadline of the process."""

    def begun(self) -> bool:
        """Whether another rank has begun a regroup: stop waiting for a collective."""


# The watches of this process, newest last. Held weakly: a watch is a Recovery, which holds a
# store client and a copy of the parameters; a strong reference here kept them for the life of
# the process, and every later wait looked at that store. Gone with the last Recovery.
_watches: list[weakref.ref[RegroupWatch]] = []


def watch_for_regroups(watch: RegroupWatch) -> None:
    """Make every deadline of this process give up a wait once ``watch`` says a regroup began,
    for as long as ``watch`` lives (it is held weakly; the newest live watch is asked).

    [Note: waking a survivor]
    When a rank dies, only the ranks that exchange data with it directly see their connection
    close; a survivor waiting for a live peer that has already left the collective (to regroup)
    would wait for the deadline. With a watch, waits run in slices of ``_SLICE_S`` and look at
    the store between slices: one ``check`` per 50 ms of waiting, nothing for a collective that
    is done when it is waited for (the common case at the end of an overlapped backward). The
    failed rank's own roll call is left to the regroup's, which holds one anyway."""
    _watches.append(weakref.ref(watch, _forget))


def _forget(gone: weakref.ref[RegroupWatch]) -> None:
    """Called by the garbage collector, on whatever thread it runs, when a watch is freed."""
    _watches[:] = [ref for ref in _watches if ref is not gone]


def _current_watch() -> RegroupWatch | None:
    """The watch deadlines look at now: the newest that lives, or ``None``."""
    for ref in reversed(_watches):
        watch = ref()
        if watch is not None:
            return watch
    return None


def wait_watching(
    handle: Any, watch: RegroupWatch, timeout: timedelta, start: float | None = None
) -> None:
    """``handle.wait()`` within ``timeout`` (counted from ``start``, ``time.monotonic()``), in
    slices, giving up with ``RuntimeError`` once ``watch`` says a regroup began ([Note: waking a
    survivor])."""
    limit = timeout.total_seconds()
    start = time.monotonic() if start is None else start
    while True:
        left = limit - (time.monotonic() - start)
        try:
            handle.wait(timeout=timedelta(seconds=max(min(_SLICE_S, left), 0.001)))
            return
        except RuntimeError:
            if handle.is_completed():  # done since the slice ran out, or its own error:
                handle.wait()  # returns, or raises that error (not the slice's timeout)
                return
            if left <= _SLICE_S:  # the deadline
                raise
        if watch.begun():
            raise RuntimeError("another rank began to regroup after losing a peer")


def regroup_begun() -> bool:
    """Whether a regroup has begun that this process should stop waiting for peers for."""
    watch = _current_watch()
    return watch is not None and watch.begun()


def watching() -> bool:
    return _current_watch() is not None


_CULPRITS = (
    "A rank that does not arrive may be busy with rank-specific work (saving, evaluating on "
    "rank 0 only), blocked in a collective the others do not issue (e.g. a logging all_reduce "
    "on some ranks only), out of data (wrap the loop in `with model.join(optimizer):`), stopped "
    "or dead. Raise `timeout=` of DistributedDataParallel if the work is legitimately that long."
)


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """``timeout`` (seconds or ``timedelta``) as a ``timedelta``; it must be positive and finite
    in either form, since a zero or infinite deadline would wait forever."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise UsageError(f"timeout must be seconds or a timedelta, got {timeout!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"timeout must be a positive, finite duration, got {timeout!r}")
    return timedelta(seconds=seconds)


def small_tensors_device(
    group: dist.ProcessGroup | None, device: torch.device | None = None
) -> torch.device:
    """Where ``group``'s collectives take gradsync's small tensors: the CPU, or under NCCL
    (CUDA tensors only) ``device`` if it is a GPU, else this rank's current one."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if device is None or device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Deadline:
    """gradsync's collectives on one process group, each bounded by ``timeout``.

    ``begin(what)`` marks the start of one of gradsync's operations (construction, a training
    step, a join round, a check): it refuses to start after a failure and writes this rank's
    arrival record. ``wait`` / ``gather_objects`` / ``all_reduce`` do the waiting.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout: timedelta,
        arrivals: ArrivalRecords,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = small_tensors_device(group, device)  # the checks' small tensors
        self.arrivals = arrivals
        self.owns_group = False  # a private group (for_group) is released after a failure
        self.seq = 0  # operations begun; the same sequence on every rank
        self.where = "construction"
        self.failure: str | None = None
        # Completed handles are kept until the next operation: dropping the last reference to
        # a finished gloo work on its worker thread can race with interpreter shutdown
        # (std::terminate in ~AsyncWork, pytorch#190489); released here, on this thread, it
        # cannot.
        self._recent: list[Handle | dist.Work] = []

    @classmethod
    def for_group(
        cls,
        group: dist.ProcessGroup | None,
        timeout: timedelta,
        namespace: str,
        device: torch.device | None = None,
        backend: str | None = None,
    ) -> Deadline:
        """A deadline for gradsync's collectives over ``group``'s ranks, on a private group
        (``group.py``) created once every rank has arrived: the arrival is checked through the
        store, so a rank that never comes fails the others within ``timeout``, not torch's."""
        arrivals = ArrivalRecords(group, namespace)
        arrivals.record(1, "construction")
        behind = arrivals.wait_for_all(1, timeout)
        if behind == [-1]:
            raise CollectiveTimeoutError(
                f"rank {arrivals.rank} reached the construction of {namespace} after another "
                f"rank had given up waiting for it ({timeout.total_seconds():g} s): this rank "
                f"was late. {_CULPRITS}"
            )
        if behind:
            raise CollectiveTimeoutError(
                f"rank {arrivals.rank} gave up waiting for the other ranks to construct "
                f"{namespace} after {timeout.total_seconds():g} s; "
                f"{arrivals.describe_missing(1)}. {_CULPRITS}"
            )
        try:
            group = private_group(group, timeout, backend)
        except RuntimeError as exc:  # a rank died between arriving and connecting
            raise CollectiveTimeoutError(
                f"rank {arrivals.rank} could not connect gradsync's process group for "
                f"{namespace} within {timeout.total_seconds():g} s ({exc}). {_CULPRITS}"
            ) from exc
        deadline = cls(group, timeout, arrivals, device)
        deadline.owns_group = True
        deadline.seq = 1
        return deadline

    def begin(self, what: str) -> None:
        """Start operation ``what``; raises if an earlier collective of this group failed."""
        self.check_usable()
        self.seq += 1
        self.where = what
        self._recent.clear()
        self.arrivals.record(self.seq, what)

    def check_usable(self) -> None:
        if self.failure is not None:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: this wrapper issues no more collectives because an earlier "
                f"one failed: {self.failure} Its process group may still hold that unfinished "
                "collective, which a late rank's next one would pair with. Re-create the process "
                "group and the wrapper (or restart the job, e.g. from a checkpoint)."
            )

    def record_error(self, error: BaseException) -> None:
        """Leave word in the arrival records that this rank raised ``error`` (for its peers)."""
        summary = first_line(error, default="")[:200]
        if isinstance(error, CollectiveTimeoutError):  # its own failure: how, not its diagnosis
            summary = summary.split("; ")[0]
        self.arrivals.record(
            self.seq, f"{self.where}, where it raised {type(error).__name__}: {summary}"
        )

    def wait(self, handle: Handle | dist.Work, what: str, *, host_deadline: bool = True) -> None:
        """Wait for ``handle`` under the deadline; on a timeout or a lost peer raise
        :class:`CollectiveTimeoutError` on this rank, naming who is missing.

        ``host_deadline=False`` waits without a host-side deadline: on NCCL a wait with a
        timeout blocks the host until the GPU is done, once per bucket, which would stall the
        launch of the rest of backward; there the process group's own timeout is the deadline.
        """
        start, watch = time.monotonic(), _current_watch()
        try:
            if not host_deadline:
                handle.wait()
            elif watch is not None and hasattr(handle, "is_completed"):
                wait_watching(handle, watch, self.timeout, start)
            else:
                handle.wait(timeout=self.timeout)
        except RuntimeError as exc:
            self._fail(what, exc, time.monotonic() - start)
        self._recent.append(handle)

    def wait_device(self, done: DeviceEvent, what: str) -> None:
        """Wait until the GPU has passed ``done`` (a CUDA event recorded after ``what``'s
        kernels), under the deadline: raise :class:`CollectiveTimeoutError` naming who is
        missing if it has not within the timeout.

        [Note: a deadline for NCCL]
        NCCL waits only make a stream wait, so a rank that never joins a collective leaves the
        others' GPUs waiting and their hosts blocked at the next read of a device value (the
        step's readout), until torch's NCCL watchdog tears the process down minutes later
        without naming anybody. Polling an event recorded after the step's collectives, before
        that read, keeps the host in control: the host would wait for the GPU there anyway, so
        the poll costs CPU, not time (a yield between queries for the first milliseconds, then
        a short sleep)."""
        start = time.monotonic()
        limit = self.timeout.total_seconds()
        while not done.query():
            waited = time.monotonic() - start
            if waited > limit:
                self._fail(what, TimeoutError("the GPU did not get past it"), waited)
            time.sleep(0 if waited < 0.005 else 0.0002)

    def _fail(self, what: str, exc: BaseException, waited: float) -> None:
        cause = first_line(exc)
        limit = self.timeout.total_seconds()
        if waited < 0.9 * limit:  # not the deadline: a peer went away
            how = f"lost a peer after {waited:.1f} s while waiting for {what} ({self.where})"
        else:
            how = f"gave up waiting for {what} ({self.where}) after {waited:.1f} s"
        # Who is missing, and who died: the roll call takes what is left of the deadline, at
        # most a couple of seconds (peers that fail with this rank answer within milliseconds).
        # Under in-process recovery the survivors' roll call names the lost, in O(1) store
        # operations each; reading every rank's record here would cost O(N) each, O(N^2) at
        # the store, at every loss.
        where = "who is lost, the survivors' roll call says"
        if not watching():
            roll_call_s = min(_ROLL_CALL_S, max(limit - waited, 0.0))
            where = self.arrivals.after_failure(self.seq, self.where, roll_call_s)
        self.failure = f"rank {self.rank} {how}; {where}. (backend: {cause})"
        error = CollectiveTimeoutError(f"{self.failure} {_CULPRITS}")
        if self.owns_group:
            assert self.group is not None
            release_group(self.group)
        raise error from exc

    def all_reduce(self, tensor: torch.Tensor, what: str, op: Any = dist.ReduceOp.SUM) -> None:
        self.check_usable()
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        assert work is not None
        self.wait(work, what)

    def gather_objects(self, obj: Any, what: str) -> list[Any]:
        """``dist.all_gather_object`` under the deadline (torch's has none): two all-gathers,
        of the pickled sizes, then of the padded bytes.

        Each rank's object travels with ``what``: a gradsync call made on some ranks only
        (``shard_optimizer()`` on rank 0) pairs its gather with another gather of the others
        (their next forward's), and without the names each rank would read the others'
        objects as answers to its own question."""
        self.check_usable()
        data = torch.frombuffer(bytearray(pickle.dumps((what, obj))), dtype=torch.uint8)
        data = data.to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        self._wait_collective(dist.all_gather(sizes, size, group=self.group, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        chunks = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait_collective(
            dist.all_gather(chunks, padded, group=self.group, async_op=True), what
        )
        every = [
            pickle.loads(c[: int(s.item())].cpu().numpy().tobytes())  # noqa: S301 (our peers)
            for c, s in zip(chunks, sizes, strict=True)
        ]
        if any(their_what != what for their_what, _ in every):
            at = "; ".join(f"rank {r} at {their_what}" for r, (their_what, _) in enumerate(every))
            raise ProtocolError(
                f"the ranks reached different gradsync operations ({at}): a call that "
                "communicates (shard_optimizer(), register_comm_hook(), a checkpoint, a "
                "wrapper's construction) was made on some ranks only, or their loops went out "
                "of step; make it on every rank, at the same point"
            )
        return [their_obj for _, their_obj in every]

    def _wait_collective(self, work: dist.Work | None, what: str) -> None:
        assert work is not None
        self.wait(work, what)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, what: str) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values: one broadcast per dtype and
        device. Coalescing matters: a BatchNorm model has hundreds of small buffers, and one
        collective each would cost more than the forward pass."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:  # a DTensor's local shard: every rank of the group holds the same one
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group_tensors in by_kind.values():
            flat = torch.cat([local(t).detach().reshape(-1) for t in group_tensors])
            self.check_usable()
            self._wait_collective(
                dist.broadcast(flat, group=self.group, group_src=src, async_op=True), what
            )
            offset = 0
            with torch.no_grad():
                for t in group_tensors:
                    n = local(t).numel()
                    local(t).copy_(flat[offset : offset + n].view_as(local(t)))
                    offset += n


_num_wrappers = 0  # wrappers built in this process: the same sequence on every rank


def new_wrapper_deadline(
    group: dist.ProcessGroup | None, timeout: timedelta, device: torch.device
) -> Deadline:
    """The deadline (and private group) of the next wrapper built in this process, whose
    replica is on ``device`` (on NCCL its checks run there, not on the current device)."""
    global _num_wrappers
    _num_wrappers += 1
    name = f"DistributedDataParallel #{_num_wrappers}"
    return Deadline.for_group(group, timeout, name, device)
