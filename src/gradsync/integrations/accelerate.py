"""HF Accelerate and the HF Trainer with ``gradsync.DistributedDataParallel`` in place of torch DDP.

``GradsyncAccelerator`` is an ``accelerate.Accelerator`` whose ``prepare_model`` wraps the model
in gradsync's wrapper exactly where Accelerate would wrap it in torch DDP (the multi-CPU and
multi-device distributed types), with the arguments Accelerate would give torch DDP: the
``DistributedDataParallelKwargs`` handler's values, ``device_ids``/``output_device`` on an
accelerator, and its communication hook. Everything else ``prepare_model`` does (device
placement, mixed precision, FP8, ``torch.compile``, FSDP, DeepSpeed, tensor parallelism, the
refusals) stays Accelerate's own. ``GradsyncTrainer`` is an HF ``Trainer`` that trains through a
``GradsyncAccelerator``.

gradsync's own options (``reduction``, ``compression``, ``timeout``, ...) go in ``ddp_options``.

Both refuse a launch of several processes that Accelerate did not make distributed (see
:func:`_refuse_undistributed`): on a machine without GPUs, ``torchrun --nproc-per-node 2``
needs ``cpu=True`` (``TrainingArguments(use_cpu=True)``), or ``ACCELERATE_USE_CPU=true``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import UsageError
from gradsync.integrations import missing, require_version, wrapper_kwargs

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, is_compiled_module, model_has_dtensor
except ImportError as exc:
    raise missing("accelerate", __name__) from exc

# `multi_device` and `parallelism_config`, which the wrap decision below reads, came in 1.10.
require_version("accelerate", accelerate.__version__, "1.10", __name__)

# Set by Accelerate itself (``device_ids``, ``output_device``) or the call (``module``).
_SET_BY_ACCELERATE = ("module", "device_ids", "output_device")


def _uses_ddp(accelerator: Accelerator) -> bool:
    """Whether ``accelerator`` wraps a trainable model in torch DDP: Accelerate's two DDP
    branches of ``Accelerator.prepare_model`` (multi-device without tensor parallelism, and
    multi-CPU; FSDP, DeepSpeed, XLA and a single process use no DDP)."""
    config = accelerator.parallelism_config
    if config is not None and config.tp_enabled:
        return False
    return (
        bool(accelerator.multi_device) or accelerator.distributed_type == DistributedType.MULTI_CPU
    )


def _launched_processes() -> tuple[int, str]:
    """How many processes of one torch.distributed job this process says it is one of, and what
    says so: torchrun's (and ``accelerate launch``'s) WORLD_SIZE, else an initialised default
    process group; 1 when neither. Not MPI's process counts (``PMI_SIZE``,
    ``OMPI_COMM_WORLD_SIZE``), which Accelerate also reads with ``cpu=True``: ``mpirun`` also
    starts independent one-process runs (a sweep), a legitimate use that an error would break."""
    world_size = os.environ.get("WORLD_SIZE", "")
    if world_size.isdigit() and int(world_size) > 1:
        return int(world_size), f"WORLD_SIZE={world_size}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), "torch.distributed's default process group"
    return 1, ""


def _refuse_undistributed(accelerator: Accelerator, fix: str) -> None:
    """Raise :class:`UsageError` when the job was launched as several processes but
    ``accelerator`` is not distributed (``distributed_type`` NO, one process).

    Accelerate does that without a word when it finds no GPU (or other accelerator) and was not
    told to use the CPU, or when LOCAL_RANK is unset and ``cpu`` is not given: every process
    then trains its own copy of the model, nothing is synchronised, each process is rank 0 of
    1, and all of them write the same checkpoints. Never a useful setup for a data-parallel
    wrapper, so an error (on every rank: each reads its own state), not a warning."""
    launched, source = _launched_processes()
    if launched <= 1 or accelerator.use_distributed:
        return
    launcher = "" if "LOCAL_RANK" in os.environ else ", launched by torchrun or accelerate launch"
    raise UsageError(
        f"launched as {launched} processes ({source}), but Accelerate set up no distributed "
        f"training (distributed_type {accelerator.distributed_type.value}, num_processes "
        f"{accelerator.num_processes}): each process would train its own model, nothing "
        "synchronised. Accelerate does so when it finds no GPU for each process and is not told "
        f"to use the CPU. To train on CPU processes, {fix}, or set ACCELERATE_USE_CPU=true in "
        f"the launch's environment; for GPUs, give each process one{launcher}"
    )


def _wrapper_kwargs(handler: Any, ddp_options: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapper's keywords from Accelerate's DDP handler (or ``None``) and ``ddp_options``."""
    return wrapper_kwargs(
        handler.to_kwargs() if handler is not None else {},
        ddp_options,
        # The Trainer fills the handler from TrainingArguments.ddp_*.
        framework="Accelerate's DistributedDataParallelKwargs (or TrainingArguments.ddp_*)",
        set_by_framework=_SET_BY_ACCELERATE,
    )


class GradsyncAccelerator(Accelerator):
    """``accelerate.Accelerator`` that data-parallelises with ``gradsync.DistributedDataParallel``.

    Takes every argument of ``Accelerator``, plus ``ddp_options``: keyword arguments for
    gradsync's wrapper beyond what Accelerate forwards (``reduction``, ``compression``,
    ``timeout``, ``check_finite``, ``process_group``, ...). A setting that Accelerate already
    forwards (from ``DistributedDataParallelKwargs``) is refused in ``ddp_options``: set it once,
    in the handler. Use it as the Accelerate docs show: ``prepare``, ``accumulate``,
    ``backward``, ``clip_grad_norm_``, ``unwrap_model``, ``save_state``.
    """

    def __init__(self, *args: Any, ddp_options: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _refuse_undistributed(self, "pass cpu=True to GradsyncAccelerator")
        self.ddp_options = dict(ddp_options or {})
        # Refuse a bad option now, and in a one-process run too: not only once launched on
        # several processes, at prepare() after other setup.
        _wrapper_kwargs(self.ddp_handler, self.ddp_options)

    def _device_ids(self) -> tuple[list[int] | None, int | None]:
        """``device_ids`` and ``output_device`` as Accelerate gives them to torch DDP."""
        if not self.multi_device or os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP") == "true":
            return None, None  # multi-CPU, or a model Accelerate was told not to place
        index = self.device.index if self.device.type == "hpu" else self.local_process_index
        return [index], index

    def _wraps(self, model: nn.Module) -> bool:
        """Whether Accelerate would wrap ``model`` in torch DDP, leaving aside the models it
        returns as they are or refuses (already prepared; DTensor parameters on devices)."""
        if getattr(model, "_is_accelerate_prepared", False) or not _uses_ddp(self):
            return False
        if self.multi_device:
            return not model_has_dtensor(model) and any(p.requires_grad for p in model.parameters())
        return True  # multi-CPU: Accelerate wraps every model

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        if evaluation_mode or not self._wraps(model):
            return super().prepare_model(model, device_placement, evaluation_mode)
        compiled_by_user = is_compiled_module(model)
        # evaluation_mode=True is Accelerate's own "everything but the distributed wrap": device
        # placement, mixed precision, FP8 and compile (and its checks of the model).
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        # Accelerate compiles last, around torch DDP: do the same around gradsync's wrapper.
        recompile = is_compiled_module(prepared) and not compiled_by_user
        inner = prepared._orig_mod if recompile else prepared
        # Accelerate marks only what it returns (so the bare model may be prepared again).
        vars(inner).pop("_is_accelerate_prepared", None)
        device_ids, output_device = self._device_ids()
        wrapped: nn.Module = DistributedDataParallel(
            inner,
            device_ids=device_ids,
            output_device=output_device,
            **_wrapper_kwargs(self.ddp_handler, self.ddp_options),
        )
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)  # a torch comm hook, if one is set
        if recompile:
            compiled = torch.compile(wrapped, **self.state.dynamo_plugin.to_kwargs())
            wrapped = cast(nn.Module, compiled)
        wrapped._is_accelerate_prepared = True  # type: ignore[assignment]  # Accelerate's flag
        return wrapped


def _define_trainer() -> type:
    """``GradsyncTrainer``, defined on first use: importing transformers takes seconds, and
    Accelerate alone does not need it."""
    try:
        import transformers
        from transformers import Trainer
    except ImportError as exc:
        raise missing("transformers", f"{__name__}.GradsyncTrainer") from exc
    # Trainer builds its Accelerator's arguments in _build_accelerator_args since 5.2.
    require_version("transformers", transformers.__version__, "5.2", f"{__name__}.GradsyncTrainer")

    class GradsyncTrainer(Trainer):
        """HF ``transformers.Trainer`` that trains through a :class:`GradsyncAccelerator`.

        Takes every argument of ``Trainer``, plus ``ddp_options`` (as for
        :class:`GradsyncAccelerator`). The settings Trainer gives torch DDP reach gradsync's
        wrapper unchanged: ``TrainingArguments.ddp_find_unused_parameters``,
        ``ddp_bucket_cap_mb``, ``ddp_broadcast_buffers`` and ``ddp_static_graph``.
        """

        def __init__(
            self, *args: Any, ddp_options: Mapping[str, Any] | None = None, **kwargs: Any
        ) -> None:
            # Trainer.__init__ builds the accelerator: the options must be in place before it.
            self.ddp_options = dict(ddp_options or {})
            self._accelerator_args: dict[str, Any] = {}
            super().__init__(*args, **kwargs)

        def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
            args: dict[str, Any] = super()._build_accelerator_args(**kwargs)
            self._accelerator_args = args
            return args

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            _refuse_undistributed(self.accelerator, "pass use_cpu=True to TrainingArguments")
            _wrapper_kwargs(self.accelerator.ddp_handler, self.ddp_options)  # refuse bad options
            if self.is_deepspeed_enabled or self.is_fsdp_enabled or not _uses_ddp(self.accelerator):
                return  # no torch DDP to replace: keep Accelerate's own accelerator
            # The same accelerator, from the same arguments, as a GradsyncAccelerator. The
            # distributed state lives in Accelerate's shared state objects, which the first
            # accelerator set up and this one reuses.
            self.accelerator = GradsyncAccelerator(
                **self._accelerator_args, ddp_options=self.ddp_options
            )
            # Bound as Trainer.create_accelerator_and_postprocess binds it, to the new one.
            self.gather_function = self.accelerator.gather_for_metrics
            if "use_gather_object" in inspect.signature(self.gather_function).parameters:
                self.gather_function = functools.partial(
                    self.gather_function, use_gather_object=self.args.eval_use_gather_object
                )

    GradsyncTrainer.__module__, GradsyncTrainer.__qualname__ = __name__, "GradsyncTrainer"
    return GradsyncTrainer


def __getattr__(name: str) -> Any:
    if name == "GradsyncTrainer":
        cls = _define_trainer()
        globals()[name] = cls  # defined once; later look-ups find it without this hook
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# GradsyncTrainer comes from __getattr__ (import * asks it too).
__all__ = ["GradsyncAccelerator", "GradsyncTrainer"]  # noqa: F822
