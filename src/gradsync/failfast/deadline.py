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
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.errors import CollectiveTimeoutError, ProtocolError, UsageError, first_line
from gradsync.failfast.arrivals import ArrivalRecords
from gradsync.failfast.group import private_group, release_group
from gradsync.failfast.waiting import SLOW_S, current_watch, wait_in_slices, watching
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
    step, a join round, a check): it refuses to start after a failure and keeps this rank's
    arrival record, which a wait that lasts puts in the store. ``wait`` / ``gather_objects`` /
    ``all_reduce`` do the waiting.
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
        self.arrivals.publish()

    def wait(
        self,
        handle: Handle | dist.Work,
        what: str,
        *,
        host_deadline: bool = True,
        together: bool = True,
    ) -> None:
        """Wait for ``handle`` under the deadline; on a timeout or a lost peer raise
        :class:`CollectiveTimeoutError` on this rank, naming who is missing.

        ``host_deadline=False`` waits without a host-side deadline: on NCCL a wait with a
        timeout blocks the host until the GPU is done, once per bucket, which would stall the
        launch of the rest of backward; there the process group's own timeout is the deadline.
        ``together=False``: ``handle``'s collective can end on this rank before every rank has
        joined it (a broadcast), so its end says nothing of where the others are.
        """
        start, on_cpu = time.monotonic(), self.device.type == "cpu"
        try:
            if not host_deadline:  # the stream waits: the host waits at wait_device
                if on_cpu:  # gloo with CUDA tensors: this wait blocks the host after all
                    self.arrivals.publish()
                handle.wait()
            else:  # a timed-out wait on NCCL aborts the communicator: no slices on their own
                if not on_cpu:
                    self.arrivals.publish()
                on_slow = self.arrivals.publish if on_cpu else None
                wait_in_slices(handle, self.timeout, start, watch=current_watch(), on_slow=on_slow)
        except RuntimeError as exc:
            self._fail(what, exc, time.monotonic() - start)
        self._recent.append(handle)
        if together and (host_deadline or on_cpu):  # done, and it needed every rank
            self.arrivals.took_part()

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
            if waited > SLOW_S:
                self.arrivals.publish()
            time.sleep(0 if waited < 0.005 else 0.0002)
        self.arrivals.took_part()

    def _fail(self, what: str, exc: BaseException, waited: float) -> None:
        self.arrivals.publish()  # before the roll call: the others read it there
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

    def _wait_collective(self, work: dist.Work | None, what: str, together: bool = True) -> None:
        assert work is not None
        self.wait(work, what, together=together)

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
                dist.broadcast(flat, group=self.group, group_src=src, async_op=True),
                what,
                together=False,
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
