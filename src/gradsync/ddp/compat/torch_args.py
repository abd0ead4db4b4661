"""torch DDP's constructor arguments, and what gradsync does with each.

``gradsync.DistributedDataParallel`` takes every parameter of
``torch.nn.parallel.DistributedDataParallel.__init__``, in torch's order, so that a torch DDP
program (nanoGPT's ``DDP(model, device_ids=[local_rank])``, Accelerate's and Lightning's
keyword lists) runs unchanged. Each one is either honoured with torch's meaning or refused with
a :class:`~gradsync.errors.UsageError` that says why and what to use instead; never silently
ignored. ``tests/unit/test_torch_args.py`` compares the wrapper's signature with torch's, so a
parameter a later torch adds fails that test until it is handled here.

- ``device_ids``, ``output_device``: checked as torch checks them, and against the module's
  device; inputs are moved to ``device_ids[0]`` before the forward.
- ``dim``: kept (torch uses it only to scatter inputs over several devices per process).
- ``broadcast_buffers``, ``forward_sync_buffers``: torch 2.13's meanings (:func:`buffer_syncing`).
- ``init_sync``: ``False`` skips the broadcast at construction; the replicas are compared.
- ``process_group``, ``device_mesh``: the ranks that hold replicas (a mesh may have several axes).
- ``bucket_cap_mb``: ``None`` is the default, as in torch; ``math.inf`` is one bucket.
- ``find_unused_parameters``, ``gradient_as_bucket_view``: torch's meanings.
- ``static_graph``: parameters unused in a step are allowed, as torch allows them.
- ``check_reduction``: deprecated in torch, no effect in either (a ``FutureWarning``).
- ``skip_all_reduce_unused_params``, ``batched_grad_copy``: performance hints, accepted.
- ``mixed_precision``, ``bucket_cap_mb_list``, ``delay_all_reduce_named_params``,
  ``param_to_hook_all_reduce``: refused, naming gradsync's way (:func:`refuse_unsupported`).
- torch's ignore list (``_set_params_and_buffers_to_ignore_for_model``): honoured.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gradsync.errors import UsageError

Device = int | str | torch.device  # how torch's device_ids and output_device name a device


@dataclass(frozen=True)
class Placement:
    """Where the replica lives, as torch DDP records it (``device_ids``, ``output_device``,
    ``device``, ``device_type``, ``is_multi_device_module``)."""

    device_ids: list[int] | None
    output_device: int | None
    device: torch.device
    device_type: str
    is_multi_device_module: bool


def _device_index(device: Any) -> int:
    """``0``, ``"cuda:0"`` or ``torch.device("cuda", 0)`` as an index (torch's rule)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, (str, torch.device)):
        index = torch.device(device).index
        if index is not None:
            return index
    raise UsageError(
        f"device_ids and output_device take device indices such as 0 or 'cuda:0', got {device!r}"
    )


def _held(module: nn.Module, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # torch refuses a module with nothing to train; gradsync wraps it (a frozen module still
    # gets its buffers synchronised and takes part in join()), placed by any tensor it holds.
    return list(params) or list(module.parameters()) or list(module.buffers())


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (or buffer); CPU if it holds none."""
    held = _held(module, ())
    return held[0].device if held else torch.device("cpu")


def placement(
    module: nn.Module, params: Sequence[torch.Tensor], device_ids: Any, output_device: Any
) -> Placement:
    """torch's rules: ``device_ids`` is ``None`` or one device, and only for a module whose
    parameters sit on one accelerator; gradsync also checks that it *is* that device, which
    torch leaves to the first forward to find out."""
    held = _held(module, params)
    devices = {p.device for p in held} or {torch.device("cpu")}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise UsageError(
            f"the module's parameters must be on one type of device, got {sorted(types)}; move "
            "the module (module.to(device)) before wrapping it"
        )
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise UsageError(f"device_ids must be None or a list of one device, got {device_ids!r}")
    if device_ids is not None and len(device_ids) > 1:
        raise UsageError(
            f"device_ids can only be None or contain a single element, got {list(device_ids)}: "
            "run one process per device (torchrun --nproc-per-node)"
        )
    (device_type,) = types
    multi = len(devices) > 1
    device = held[0].device if held else torch.device("cpu")
    if device_type == "cuda" and not multi and device.index != torch.cuda.current_device():
        raise UsageError(
            f"the module's parameters are on {device}, but this process's current CUDA device "
            f"is cuda:{torch.cuda.current_device()}; call torch.cuda.set_device({device.index}) "
            "before wrapping (torchrun: torch.cuda.set_device(int(os.environ['LOCAL_RANK']))), "
            "so that NCCL and every CUDA tensor not placed explicitly use the replica's GPU"
        )
    if not device_ids or device_type == "cpu" or multi:
        if device_ids or output_device is not None:
            raise UsageError(
                "device_ids and output_device only apply to a module on a single accelerator "
                f"device; this module's parameters are on {sorted(map(str, devices))}, so pass "
                f"device_ids=None (got device_ids={device_ids!r}, output_device={output_device!r})"
            )
        return Placement(None, None, device, device_type, multi)
    ids = [_device_index(d) for d in device_ids]
    if ids[0] != device.index:
        raise UsageError(
            f"device_ids={list(device_ids)} names {device_type}:{ids[0]}, but the module's "
            f"parameters are on {device}; move the module there first "
            f"(module.to('{device_type}:{ids[0]}')) or pass device_ids=[{device.index}]"
        )
    out = ids[0] if output_device is None else _device_index(output_device)
    return Placement(ids, out, device, device_type, False)


def buffer_syncing(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """(sync buffers before each training forward, sync them at construction).

    torch 2.13's rules: ``forward_sync_buffers`` is the new name of the per-forward broadcast
    and leaves the construction-time broadcast on; ``broadcast_buffers=False`` (the old name)
    turns off both, for buffers that are meant to differ between ranks. When both are given,
    ``forward_sync_buffers`` wins (see :func:`warn_deprecated`)."""
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def warn_deprecated(
    check_reduction: bool, broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> None:
    """The warnings torch gives for the same arguments, where gradsync agrees with them."""
    if broadcast_buffers is not None and forward_sync_buffers is not None:
        warnings.warn(
            "both broadcast_buffers and forward_sync_buffers were given; broadcast_buffers is "
            "ignored (as in torch DDP)",
            UserWarning,
            stacklevel=3,
        )
    if check_reduction:
        warnings.warn(
            "the check_reduction argument of DistributedDataParallel is deprecated in torch and "
            "has no effect (gradsync always checks that every gradient was reduced)",
            FutureWarning,
            stacklevel=3,
        )


# torch's arguments with no equivalent here: refused, naming what to use instead.
UNSUPPORTED = (
    "delay_all_reduce_named_params",
    "param_to_hook_all_reduce",
    "mixed_precision",
    "bucket_cap_mb_list",
)


def refuse_unsupported(
    *,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    bucket_cap_mb_list: Any,
) -> None:
    """Refuse torch's arguments gradsync has no equivalent of, naming what to use instead."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise UsageError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time (as in torch DDP)"
        )
    if delay_all_reduce_named_params is not None:
        raise UsageError(
            "delay_all_reduce_named_params / param_to_hook_all_reduce are not supported: gradsync "
            "reduces every trainable parameter in its buckets; to keep a parameter out of data "
            "parallelism, set requires_grad=False or list it in "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)"
        )
    if mixed_precision is not None:
        raise UsageError(
            "mixed_precision (torch DDP's experimental _MixedPrecision) is not supported; in "
            "gradsync use torch.autocast for mixed-precision compute, compression='bf16' for a "
            "bf16 wire, or main_grad_dtype=torch.float32 for a bf16 model with fp32 gradients"
        )
    if bucket_cap_mb_list is not None:
        raise UsageError(
            "bucket_cap_mb_list is not supported; use bucket_cap_mb with first_bucket_cap_mb "
            "(a smaller first bucket), or bucket_cap_mb='auto' to choose the caps from this "
            "job's own profile"
        )


def ignored_names(module: nn.Module) -> set[str]:
    """Parameter and buffer names torch DDP leaves alone: set with
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)``
    (TorchRec and sparse-embedding code use it)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def resolve(
    module: nn.Module, ignore: AbstractSet[str], arguments: Mapping[str, Any]
) -> tuple[Placement, bool, bool]:
    """The wrapper's reading of torch's arguments among its constructor's ``arguments`` (by
    name): where the replica lives, and whether buffers are synchronised before each forward
    and at construction. Raises ``UsageError`` for an argument gradsync refuses
    (:func:`refuse_unsupported`)."""
    refuse_unsupported(**{name: arguments[name] for name in UNSUPPORTED})
    trainable = [p for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
    where = placement(module, trainable, arguments["device_ids"], arguments["output_device"])
    buffers, forward_sync = arguments["broadcast_buffers"], arguments["forward_sync_buffers"]
    return (where, *buffer_syncing(buffers, forward_sync))


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``: torch DDP's ``_to_kwargs`` for one
    device, what a forward does with its inputs when ``device_ids`` is given."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, tree)
