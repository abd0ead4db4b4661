"""Every setting of a :class:`~gradsync.DistributedDataParallel`, in one frozen object.

:class:`SyncOptions` is what the wrapper was asked for, checked once. It is what the model check
at construction compares across ranks (:meth:`SyncOptions.settings`), what every reducer is
built from (the first one, and each one that replaces it: ``bucket_cap_mb="auto"``,
``shard_optimizer()``, ``register_comm_hook()``), and what the per-step code reads. A new
setting is one field here, with its docstring, read where it matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch

from gradsync.comm import AllReduceAlgorithm, PowerSGD, get_algorithm
from gradsync.comm.formats import Compression, describe_compression, describe_compression_state
from gradsync.ddp.deterministic import deterministic_settings, refuse_in_deterministic_mode
from gradsync.ddp.plan import check_cap
from gradsync.ddp.reduction import check_reduction
from gradsync.errors import UsageError


@dataclass(frozen=True)
class SyncOptions:
    """The wrapper's settings; the constructor's keyword arguments of the same names."""

    bucket_cap_mb: float | str | None = None
    """Bucket size in MiB: ``None``, the default (torch's 25 MiB where every rank of the group
    shares one host, ``"scaled"`` across hosts: see [Note: the default bucket cap] in
    ``plan.py``), ``"scaled"`` (an eighth of the gradients' bytes, between 1 and 25 MiB), a
    number (``0``: a bucket per parameter; ``math.inf``: one bucket per dtype) or ``"auto"``
    (chosen from this job's profile; see ``autotune.py``)."""

    first_bucket_cap_mb: float | None = 1.0
    """A lower cap for the first bucket (the last layers' gradients), so that communication
    starts early in backward; ``None``: ``bucket_cap_mb`` for every bucket."""

    find_unused_parameters: bool = False
    """Count a parameter without a gradient on some rank as zero there, instead of raising
    ``UnusedParametersError`` on every rank."""

    static_graph: bool = False
    """torch DDP's promise that every step uses the same parameters: parameters unused in a
    step are then allowed (they contribute zeros, as with ``find_unused_parameters``)."""

    gradient_as_bucket_view: bool = False
    """Make ``.grad`` tensors views into the bucket buffers (one copy and one set of gradients
    less)."""

    broadcast_buffers: bool = True
    """Copy rank 0's buffers to every rank before each training-mode forward with grad
    (torch 2.13 calls this ``forward_sync_buffers``; see ``torch_args.buffer_syncing``)."""

    init_sync: bool = True
    """Broadcast rank 0's parameters at construction; ``False``: the replicas must already be
    equal, which is checked instead (a checksum per parameter)."""

    init_sync_buffers: bool = True
    """Broadcast rank 0's buffers at construction (``broadcast_buffers=False`` turns it off, as
    in torch, for buffers meant to differ between ranks)."""

    reduction: str = "mean"
    """``"mean"``, ``"sum"`` or ``"item_mean"``: what the summed gradient is divided by
    (``reduction.py``)."""

    algorithm: AllReduceAlgorithm | str = "native"
    """The all-reduce of every bucket: a name from ``gradsync.comm.ALGORITHMS`` or an instance
    (stored as the instance)."""

    compression: Compression = None
    """The gradients' wire format: ``None``, ``"bf16"``, ``"fp16"`` or a ``PowerSGD``."""

    timeout: timedelta = timedelta(seconds=300.0)
    """The deadline of each of the wrapper's collectives (``failfast/deadline.py``)."""

    check_finite: bool = False
    """Check every bucket for NaN/Inf before communication (one device read per bucket)."""

    check_replicas_every: int = 0
    """Compare parameter checksums across ranks every this many optimizer steps (0: never)."""

    main_grad_dtype: torch.dtype | None = None
    """Accumulate and reduce gradients in this dtype, into ``p.main_grad`` (``main_grads.py``);
    whether the module allows it is checked by the wrapper, which holds the module."""

    straggler_every: int = 10
    """Every this many steps, rank 0 logs the ranks that made the others wait, and in which
    phase (logger ``gradsync.stragglers``); ``0`` turns the step timeline off (nothing is
    measured or carried). See [Note: naming a straggler] in ``timing/attribution.py``."""

    deterministic: int | None = None
    """The deterministic mode: the number of *leaves* (micro-batches of a fixed size, each with
    its own backward) in a full step, summed in one fixed order whatever the world size, so that
    the parameters are the same bits at any N ([Note: the fixed leaf tree] in
    ``comm/tree.py``); ``None``: off. Take it from ``GlobalBatchSampler(...,
    deterministic=True).leaves_per_step``. See ``deterministic.py`` for what it requires."""

    def __post_init__(self) -> None:
        # A refusal here is a UsageError naming the setting; the wrapper raises it on every rank.
        check_reduction(self.reduction)
        if (
            isinstance(self.straggler_every, bool)
            or not isinstance(self.straggler_every, int)
            or self.straggler_every < 0
        ):
            raise UsageError(f"straggler_every must be an int >= 0, got {self.straggler_every!r}")
        check_cap(self.first_bucket_cap_mb, "first_bucket_cap_mb", words=())
        object.__setattr__(self, "algorithm", get_algorithm(self.algorithm))
        describe_compression(self.compression)
        check_cap(self.bucket_cap_mb)
        refuse_in_deterministic_mode(self.deterministic, self.compression, self.all_reduce.name)
        if self.auto and isinstance(self.compression, PowerSGD):
            raise UsageError(
                "bucket_cap_mb='auto' cannot be combined with compression=PowerSGD: its "
                "matrices and error feedback are kept per bucket and would be lost when the plan "
                "switches; pass a numeric bucket_cap_mb"
            )

    @classmethod
    def of(cls, arguments: Mapping[str, Any], **resolved: Any) -> SyncOptions:
        """The options among a constructor's ``arguments`` (each field by its name), with the
        values ``resolved`` from torch's arguments in their place: a new setting is a field
        here and a keyword of the wrapper's of the same name."""
        names = {f.name for f in fields(cls)}
        return cls(
            **{n: v for n, v in arguments.items() if n in names and n not in resolved}, **resolved
        )

    @property
    def all_reduce(self) -> AllReduceAlgorithm:
        """The algorithm instance (``algorithm`` after construction)."""
        assert isinstance(self.algorithm, AllReduceAlgorithm)
        return self.algorithm

    @property
    def auto(self) -> bool:
        """``bucket_cap_mb="auto"``: the plan may be replaced after a few steps."""
        return self.bucket_cap_mb == "auto"

    @property
    def tolerates_unused(self) -> bool:
        """A parameter may get no gradient in a step (``find_unused_parameters`` or
        ``static_graph``)."""
        return self.find_unused_parameters or self.static_graph

    @property
    def main_grads(self) -> bool:
        """Buckets own the gradients, in ``main_grad_dtype`` ([Note: main gradients])."""
        return self.main_grad_dtype is not None

    def settings(self, mesh_axes: object = None) -> dict[str, Any]:
        """What must be the same on every rank, compared by the model check at construction:
        every setting that changes which collectives run or what they carry (``mesh_axes``:
        the names of the device mesh's axes reduced over, if any)."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "reduction": self.reduction,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "broadcast_buffers": self.broadcast_buffers,
            "init_sync": self.init_sync,
            "init_sync_buffers": self.init_sync_buffers,
            "algorithm": self.all_reduce.name,
            "compression": describe_compression(self.compression),
            "check_finite": self.check_finite,
            "check_replicas_every": self.check_replicas_every,
            "device_mesh": mesh_axes,
            "main_grad_dtype": str(self.main_grad_dtype),
            "compression state (load it on every rank)": describe_compression_state(
                self.compression
            ),
            "deterministic": self.deterministic,
            **deterministic_settings(self.deterministic),
        }


class Setting:
    """A read-only attribute of the wrapper that reads one field of its :class:`SyncOptions`
    (``reduction = Setting()`` reads ``options.reduction``). torch keeps some of these as plain
    attributes; here an assignment raises ``AttributeError``, because a setting changed on one
    rank after the cross-rank check at construction would silently desynchronise the ranks."""

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.field = name, self.field or name

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        return self if wrapper is None else getattr(wrapper.options, str(self.field))

    def __set__(self, wrapper: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is read-only on a gradsync wrapper: settings must agree across ranks, "
            "so pass it to the constructor on every rank"
        )
