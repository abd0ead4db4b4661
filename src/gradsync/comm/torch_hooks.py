"""torch's DDP communication hooks on gradsync's buckets: ``register_comm_hook(state, hook)``.

A hook of ``torch.distributed.algorithms.ddp_comm_hooks`` (``allreduce_hook``,
``fp16_compress_hook``, ``powerSGD_hook``, ...) is ``hook(state, bucket) -> Future[Tensor]``,
where ``bucket`` is a ``dist.GradBucket``. torch 2.13 gives ``GradBucket`` no Python
constructor, so :class:`GradBucketView` is a duck type with the same methods and meanings:
``buffer()`` is the flat gradients (without gradsync's used flags and step tags, which the
adapter sums exactly in a separate small all-reduce), ``gradients()`` views of the current
buffer shaped like ``parameters()``, ``set_buffer()`` replaces it, ``index()`` and
``is_last()`` number the buckets in launch order.

As in torch DDP, the hook receives undivided gradients and averages them itself over its
process group, which must be the wrapper's: the reduction multiplies its pre-division by the
world size (``Reduction.wire_divides``) so ``mean``, ``sum`` and ``item_mean`` keep their
meaning. The hook runs on a worker thread, one bucket after another, its future awaited there:
the collectives torch's PowerSGD chains in ``then`` callbacks would otherwise interleave with
the next bucket's in a different order on different ranks (gloo pairs collectives by order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import Handle
from gradsync.comm.hook import BucketLike, CommHook, tail
from gradsync.comm.worker import SerialWorker
from gradsync.errors import ProtocolError, UsageError


class GradBucketView:
    """Stands in for ``torch.distributed.GradBucket`` (same methods, same meanings)."""

    def __init__(
        self,
        index: int,
        num_buckets: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor],
    ) -> None:
        self._index = index
        self._is_last = index == num_buckets - 1
        self._buffer = buffer
        self._params = list(params)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of the current buffer, one per parameter, shaped like it."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views


class TorchHookAdapter(CommHook):
    """Runs ``hook(state, bucket)`` for each of gradsync's buckets."""

    def __init__(
        self,
        state: object,
        hook: Callable[..., Any],
        group: dist.ProcessGroup | None,
        num_buckets: int,
    ) -> None:
        self.state = state
        self.hook = hook
        self.group = group  # gradsync's own group, for the exact flags and tags
        self.num_buckets = num_buckets
        self._worker = SerialWorker("gradsync-torch-hook")

    def start(self, bucket: BucketLike) -> Handle:
        return self._worker.submit(lambda: self._reduce(bucket))

    def _reduce(self, bucket: BucketLike) -> None:
        view = GradBucketView(bucket.spec.index, self.num_buckets, bucket.grads, bucket.params)
        future = self.hook(self.state, view)
        if not callable(getattr(future, "wait", None)):  # torch.futures.Future or its C type
            raise TypeError(
                f"communication hook {hook_name(self.hook)} returned {type(future).__name__}, "
                "not a torch.futures.Future"
            )
        result = future.wait()
        if isinstance(result, (list, tuple)):  # e.g. a bare all_reduce(...).get_future()
            result = result[0]
        if result is not bucket.grads:
            bucket.grads.copy_(result.view(-1))
        dist.all_reduce(tail(bucket), group=self.group)


def register(wrapper: Any, state: object, hook: Callable[..., Any]) -> None:
    """``DistributedDataParallel.register_comm_hook``: checks, agreement, installation."""
    check_registration(
        hook,
        compression=wrapper._compression_name,
        algorithm=wrapper.algorithm.name,
        started=wrapper._forward_ran,
        again=wrapper._torch_hook is not None,
    )
    if wrapper._autotune is not None:  # its state may be per bucket (PowerSGD's is)
        raise UsageError("register_comm_hook cannot be combined with bucket_cap_mb='auto'")
    deadline = wrapper._deadline
    agree_on_hook(identity_of(state, hook), deadline.gather_objects)
    reducer = wrapper.reducer
    reducer.comm_hook = TorchHookAdapter(state, hook, deadline.group, len(reducer.buckets))
    reducer.reduction.wire_divides = deadline.world_size
    wrapper._torch_hook = hook


def hook_name(hook: Callable[..., Any]) -> str:
    module = getattr(hook, "__module__", None) or "?"
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{module}.{name}"


def check_registration(
    hook: Callable[..., Any], *, compression: str, algorithm: str, started: bool, again: bool
) -> None:
    """Refuse, on this rank, a registration that torch DDP would refuse or that would mix
    with another of the wrapper's choices."""
    if not callable(hook):
        raise UsageError(f"register_comm_hook needs a callable hook, got {hook!r}")
    if again:
        raise ProtocolError("register_comm_hook can only be called once per wrapper")
    if started:
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


def agree_on_hook(identity: str, gather: Callable[[str, str], list[Any]]) -> None:
    """Raise on every rank unless every rank registered the same hook (by name and state
    type): one small all-gather. ``gather(obj, what)`` is the wrapper's deadline-bound
    all-gather of objects."""
    every = gather(identity, "the check that every rank registered the same comm hook")
    if len(set(every)) > 1:
        lines = "; ".join(f"rank {r}: {h}" for r, h in enumerate(every))
        raise UsageError(f"ranks registered different communication hooks ({lines})")


def identity_of(state: object, hook: Callable[..., Any]) -> str:
    return f"{hook_name(hook)} with state of type {type(state).__qualname__}"
