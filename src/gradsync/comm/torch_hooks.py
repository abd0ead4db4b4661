"""torch's DDP communication hooks on gradsync's buckets: ``register_comm_hook(state, hook)``.

A hook of ``torch.distributed.algorithms.ddp_comm_hooks`` (``allreduce_hook``,
``fp16_compress_hook``, ``powerSGD_hook``, ...) is ``hook(state, bucket) -> Future[Tensor]``,
where ``bucket`` is a ``dist.GradBucket``, here a :class:`GradBucketView` (``grad_bucket.py``)
of the bucket's gradients, without gradsync's used flags and step tags, which the adapter sums
exactly in a separate small all-reduce.

As in torch DDP, the hook receives undivided gradients and averages them itself over its
process group, which must be the wrapper's: the reduction multiplies its pre-division by the
world size (``CommHook.divides_by``) so ``mean``, ``sum`` and ``item_mean`` keep their
meaning. The hook runs on a worker thread, one bucket after another, its future awaited there:
the collectives torch's PowerSGD chains in ``then`` callbacks would otherwise interleave with
the next bucket's in a different order on different ranks (gloo pairs collectives by order).

[Note: the hook's process group]
Running on a worker thread, the hook's collectives are issued concurrently with whatever the
autograd thread issues, e.g. the backward of ``torch.distributed.nn.functional.all_reduce`` or
of a gathered contrastive loss. On one group the two would pair in a different order on each
rank and sum unrelated tensors. So the hook gets gradsync's private group (the wrapper's
deadline group, which nothing in the user's code can use) wherever it would have used the
wrapper's ranks: a ``state`` of ``None`` or a process group of exactly the wrapper's ranks is
passed as that group, and a state's ``process_group`` attribute (``PowerSGDState``) that is
``None`` or has the wrapper's ranks is set to it at registration (so a state that served
another wrapper is recognised). Any other group is left alone: collectives the hook issues
there can interleave with those of the model's backward."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradsync.comm import torch_hook_state
from gradsync.comm.algorithm import Handle
from gradsync.comm.grad_bucket import GradBucketView
from gradsync.comm.hook import BucketLike, CommHook, tail
from gradsync.comm.worker import SerialWorker
from gradsync.errors import GradsyncError, ProtocolError, UsageError, first_line
from gradsync.failfast.deadline import Deadline
from gradsync.failfast.group import is_backend_failure


class TorchHookAdapter(CommHook):
    """Runs ``hook(state, bucket)`` for each of gradsync's buckets, on ``deadline.group``'s
    ranks; a hook that raises or returns a wrong result raises :class:`UsageError` naming
    the hook, the bucket and the cause, recorded with the deadline for the peers' errors."""

    def __init__(
        self,
        state: object,
        hook: Callable[..., Any],
        deadline: Deadline,
        bucket_numels: Sequence[int],
    ) -> None:
        self.state = state
        self.hook = hook
        self.deadline = deadline
        self.group = deadline.group  # gradsync's own group, for the exact flags and tags
        self.bucket_numels = list(bucket_numels)  # gradients per bucket (for loads' checks)
        self.num_buckets = len(self.bucket_numels)
        self.divides_by = deadline.world_size  # torch's hooks average
        self._worker = SerialWorker("gradsync-torch-hook")

    def start(self, bucket: BucketLike) -> Handle:
        return self._worker.submit(lambda: self._reduce(bucket))

    # torch's PowerSGDState survives checkpoints: see torch_hook_state.py.
    def state_dict(self) -> dict[str, Any]:
        return torch_hook_state.state_dict(self.state, self.deadline.rank)

    def load_problem(self, state: dict[str, Any]) -> str | None:
        return torch_hook_state.load_problem(state, self.deadline.rank, self.bucket_numels)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank, device = self.deadline.rank, self.deadline.device
        torch_hook_state.load_state_dict(self.state, state, rank, device)

    def _reduce(self, bucket: BucketLike) -> None:
        try:
            self._run_hook(bucket)
        except GradsyncError as exc:
            # Recorded now, on this thread: a peer waiting for this rank quotes it.
            self.deadline.record_error(exc)
            raise
        dist.all_reduce(tail(bucket), group=self.group)

    def _run_hook(self, bucket: BucketLike) -> None:
        index = bucket.spec.index
        try:
            view = GradBucketView(index, self.num_buckets, bucket.grads, bucket.params)
            future = self.hook(self.state, view)
            if not callable(getattr(future, "wait", None)):  # torch.futures.Future or C type
                raise self._fault(
                    index, f"returned {type(future).__name__}, not a torch.futures.Future"
                )
            result = self._checked(future.wait(), bucket)
            if result is not bucket.grads:
                # Another float dtype is cast, as torch DDP does.
                bucket.grads.copy_(result.reshape(-1))
        except GradsyncError:
            raise
        except Exception as exc:
            if is_backend_failure(exc):
                raise  # a lost peer or a timeout: the deadline names the rank at fault
            cause = first_line(exc, default="")
            raise self._fault(index, f"raised {type(exc).__name__}: {cause}") from exc

    def _checked(self, result: object, bucket: BucketLike) -> torch.Tensor:
        """The future's value as the bucket's reduced gradients, or a clear error: a value of
        another size would be broadcast or cut silently."""
        index, expected = bucket.spec.index, bucket.grads.numel()
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]  # e.g. a bare all_reduce(...).get_future()
        if not isinstance(result, torch.Tensor):
            raise self._fault(
                index,
                f"its future's value is {type(result).__name__}, not a tensor of the "
                f"bucket's {expected} gradient elements",
            )
        if result.numel() != expected:
            raise self._fault(
                index,
                f"its future's value has {result.numel()} elements, the bucket {expected} "
                "gradient elements (the value must be the whole bucket, reduced)",
            )
        if not result.is_floating_point():
            raise self._fault(
                index, f"its future's value has dtype {result.dtype}, not a floating-point one"
            )
        return result

    def _fault(self, index: int, what: str) -> UsageError:
        # A ValueError: Deadline.wait would report a RuntimeError as a lost peer.
        return UsageError(f"communication hook {hook_name(self.hook)} on bucket {index}: {what}")


# -- registration ---------------------------------------------------------------------------------
def register(
    state: object,
    hook: Callable[..., Any],
    deadline: Deadline,
    bucket_numels: Sequence[int],
    wrapper: WrapperFacts,
) -> TorchHookAdapter:
    """``DistributedDataParallel.register_comm_hook``: checks and agreement; returns the
    adapter for the wrapper to install, over buckets of ``bucket_numels`` gradients.

    A registration that fails on this rank raises here at once and leaves word for the peers
    (their own registration, or their deadline, quotes it); see :func:`agree_on_hook`.
    """
    try:
        check_registration(hook, wrapper)
        torch_hook_state.refuse_reused(state)
    except GradsyncError as exc:
        if not wrapper.registered:  # a hook already agreed on stays announced
            announce(deadline, {"hook": f"none (its registration raised {_summary(exc)})"})
        deadline.record_error(exc)
        raise
    private = deadline.group
    assert private is not None, "a wrapper's deadline always has its private group"
    hook_state = state_for_hook(state, private)
    try:
        agree_on_hook(identity_of(hook_state, hook), deadline)
    except GradsyncError as exc:
        deadline.record_error(exc)
        raise
    adopt_private_group(hook_state, private)
    return TorchHookAdapter(hook_state, hook, deadline, bucket_numels)


def hook_name(hook: Callable[..., Any]) -> str:
    func = getattr(hook, "func", None)
    if func is not None and hasattr(hook, "args"):  # functools.partial: name what it wraps
        return f"partial({hook_name(func)})"
    module = getattr(hook, "__module__", None) or "?"
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    code = getattr(hook, "__code__", None)
    if "<lambda>" in name and code is not None:  # all lambdas share one name
        name = f"{name} (line {code.co_firstlineno})"
    return f"{module}.{name}"


class WrapperFacts(NamedTuple):
    """What a registration must know of the wrapper it is for."""

    compression: str  # describe_compression(...) of its compression
    algorithm: str  # its all-reduce algorithm's name
    registered: bool  # a hook was registered already
    forward_ran: bool  # a forward ran through it
    sharded: bool  # shard_optimizer() was called
    auto: bool  # bucket_cap_mb="auto"
    deterministic: bool = False  # deterministic=


def check_registration(hook: Callable[..., Any], wrapper: WrapperFacts) -> None:
    """Refuse on this rank a registration torch DDP refuses, or one at odds with the wrapper."""
    compression, algorithm = wrapper.compression, wrapper.algorithm
    if not callable(hook):
        raise UsageError(f"register_comm_hook needs a callable hook, got {hook!r}")
    if wrapper.registered:
        raise ProtocolError("register_comm_hook can only be called once per wrapper")
    if wrapper.forward_ran:
        raise ProtocolError(
            "register_comm_hook must be called before the first forward through the "
            "wrapper (as in torch DDP): buckets already went through the previous hook"
        )
    if compression != "none" or algorithm != "native":
        raise UsageError(
            "register_comm_hook replaces the wrapper's own communication; construct it with "
            f"compression=None and algorithm='native' (got compression={compression}, "
            f"algorithm={algorithm!r})"
        )
    # ZeRO-1 refuses the reverse order; "auto" replans buckets whose hook state may be per
    # bucket (PowerSGD's); deterministic= fixes the order of the sums that a hook would choose.
    other = {"shard_optimizer()": wrapper.sharded, "bucket_cap_mb='auto'": wrapper.auto}
    for what in (n for n, on in {**other, "deterministic=": wrapper.deterministic}.items() if on):
        raise UsageError(f"register_comm_hook cannot be combined with {what}")


# -- the hook's process group: see [Note: the hook's process group]; reuse: torch_hook_state.py --
def _ranks(group: object) -> list[int] | None:
    try:
        return dist.get_process_group_ranks(group)  # type: ignore[arg-type]
    except Exception:  # not a group this rank belongs to
        return None


def _is_wrappers(group: object, private: dist.ProcessGroup) -> bool:
    same = isinstance(group, dist.ProcessGroup) and _ranks(group) == _ranks(private)
    return group is None or same


def state_for_hook(state: object, private: dist.ProcessGroup) -> object:
    """The state to pass: the private group where ``state`` stands for the wrapper's ranks."""
    return private if _is_wrappers(state, private) else state


def adopt_private_group(state: object, private: dist.ProcessGroup) -> None:
    """Point a state's ``process_group`` (``PowerSGDState``'s) at the private group when it
    stands for the wrapper's ranks (this changes the user's state object)."""
    if hasattr(state, "process_group") and _is_wrappers(state.process_group, private):
        state.process_group = private
        torch_hook_state.adopted(private)  # a second wrapper will refuse it


# -- agreement across ranks ----------------------------------------------------------------------
def identity_of(state: object, hook: Callable[..., Any]) -> dict[str, str]:
    """What must be the same on every rank: the hook, the state's type and its plain
    settings (``PowerSGDState``'s rank, start iteration, ...), each by ``repr``."""
    if isinstance(state, dist.ProcessGroup):
        kind = f"ProcessGroup of ranks {_ranks(state)}"
    else:
        kind = type(state).__qualname__
    identity = {"hook": hook_name(hook), "state": kind}
    for name, value in plain_settings(state).items():
        identity[f"state.{name}"] = repr(value)
    return identity


def plain_settings(state: object) -> dict[str, object]:
    """``state``'s attributes (``__dict__`` and ``__slots__``) that are ints, floats, bools,
    strings or ``None``, sorted by name; tensors, dicts, RNGs and groups are skipped."""
    names = set(getattr(state, "__dict__", {}))
    for cls in type(state).__mro__:
        slots = getattr(cls, "__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
    out: dict[str, object] = {}
    for name in sorted(names):
        value = getattr(state, name, None)
        if name == "process_group" or not (value is None or isinstance(value, (int, float, str))):
            continue
        out[name] = value
    return out


def agree_on_hook(identity: dict[str, str], deadline: Deadline) -> None:
    """Raise :class:`UsageError` unless every rank registered the same hook and settings.

    Without a collective: a collective here would pair with a peer's next one if that peer did
    not register (or its registration failed). Each rank publishes its identity in the c10d
    store and reads the others', waiting at most the deadline; a peer that has begun a later
    operation (its first forward) without publishing registered nothing. On a mismatch every
    registering rank raises here, the error is recorded, and a peer that went on without
    registering quotes it when its next collective reaches the deadline.
    """
    if deadline.arrivals.store is None:  # no c10d store (a custom launcher): one all-gather
        what = "the check that every rank registered the same comm hook"
        every = deadline.gather_objects(identity, what)
    else:
        announce(deadline, identity)
        every = _read_identities(deadline)
    problem = disagreement(every)
    if problem is not None:
        raise UsageError(problem)


def _key(deadline: Deadline, rank: int) -> str:
    arrivals = deadline.arrivals
    return f"{arrivals.namespace}comm_hook/{arrivals.global_ranks[rank]}"


def announce(deadline: Deadline, identity: dict[str, str]) -> None:
    """Publish this rank's identity (or its failure) for the peers' :func:`agree_on_hook`."""
    store = deadline.arrivals.store
    try:
        if store is not None:
            store.set(_key(deadline, deadline.rank), json.dumps(identity))
    except Exception:  # a failing store: the peers wait for the deadline, then say so
        pass


def _read(store: dist.Store, key: str) -> dict[str, str] | None:
    try:
        if not store.check([key]):  # get() would block until the key exists
            return None
        return dict(json.loads(store.get(key).decode()))
    except Exception:
        return None


def _read_identities(deadline: Deadline) -> list[dict[str, str]]:
    store = deadline.arrivals.store
    assert store is not None
    give_up = time.monotonic() + deadline.timeout.total_seconds()
    pause = 0.001
    while True:
        every = [_read(store, _key(deadline, r)) for r in range(deadline.world_size)]
        missing = [r for r, identity in enumerate(every) if identity is None]
        if not missing:
            return [identity for identity in every if identity is not None]
        records = deadline.arrivals.read()
        went_on = {r: records[r][2] for r in missing if records.get(r, (0,))[0] > deadline.seq}
        # A peer publishes before it can go on: one that published between the read of the keys
        # and the read of the records has its key now. Only a peer still without one skipped.
        for r in list(went_on):
            every[r] = _read(store, _key(deadline, r))
            if every[r] is not None:
                del went_on[r]
                missing.remove(r)
        if not missing:
            return [identity for identity in every if identity is not None]
        if went_on or time.monotonic() >= give_up:
            late = f"none registered within {deadline.timeout.total_seconds():g} s"
            for r in missing:
                went = f"none (it went on to {went_on[r]} without registering one)"
                every[r] = {"hook": went if r in went_on else late}
            return [identity for identity in every if identity is not None]
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def disagreement(every: list[dict[str, str]]) -> str | None:
    """The message for ranks whose identities differ (``None`` if all agree): the hooks if
    they differ, else the state's type, else each differing setting with its values."""
    if all(identity == every[0] for identity in every):
        return None
    for key in ("hook", "state"):
        values = [identity.get(key, "-") for identity in every]
        if len(set(values)) > 1:
            lines = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            noun = "communication hooks" if key == "hook" else "hook states"
            return f"ranks registered different {noun} ({lines})"
    keys = sorted({k for identity in every for k in identity})
    differing = []
    for key in keys:
        values = [identity.get(key, "-") for identity in every]
        if len(set(values)) > 1:
            differing.append(f"{key.removeprefix('state.')} is {_by_value(values)}")
    return (
        f"ranks registered {every[0]['hook'].rsplit('.', 1)[-1]} with different "
        f"{every[0]['state']} settings: {'; '.join(differing)}"
    )


def _by_value(values: list[str]) -> str:
    """``"1 on rank 0, 2 on ranks [1, 2]"``."""
    ranks: dict[str, list[int]] = {}
    for r, value in enumerate(values):
        ranks.setdefault(value, []).append(r)
    return ", ".join(
        f"{v} on rank {rs[0]}" if len(rs) == 1 else f"{v} on ranks {rs}" for v, rs in ranks.items()
    )


def _summary(exc: BaseException) -> str:
    text = first_line(exc, default="")
    return f"{type(exc).__name__}: {text.removeprefix('gradsync: ')}"[:300]
