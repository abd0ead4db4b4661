"""Lightning with ``gradsync.DistributedDataParallel`` in place of torch DDP.

``GradsyncStrategy`` is Lightning's ``DDPStrategy`` (``lightning.pytorch``) and
``GradsyncFabricStrategy`` is Fabric's (``lightning.fabric``); each replaces only the line that
builds torch DDP, so launching, process groups, samplers, precision, gradient accumulation and
clipping stay Lightning's. The keyword arguments ``DDPStrategy`` passes on to torch DDP
(``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``, ...) go to gradsync's wrapper;
gradsync's own options go in ``ddp_options``. Importing this module also registers the strategy
names ``"gradsync"``, ``"gradsync_spawn"`` and ``"gradsync_fork"`` with both registries.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.integrations import missing, require_version, wrapper_kwargs

try:
    import lightning
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as exc:
    raise missing("lightning", __name__) from exc

# The override points (DDPStrategy._setup_model, Fabric's DDPStrategy.setup_module) since 2.2.
require_version("lightning", lightning.__version__, "2.2", __name__)

# Name -> start method, as Lightning names its own "ddp", "ddp_spawn" and "ddp_fork".
_NAMES = {"gradsync": "popen", "gradsync_spawn": "spawn", "gradsync_fork": "fork"}


def _side_stream(device_ids: list[int] | None) -> AbstractContextManager[Any]:
    # As Lightning builds torch DDP: on a side CUDA stream when the model is on a GPU
    # (https://pytorch.org/docs/stable/notes/cuda.html#id5).
    return torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()


def _options(strategy_kwargs: Mapping[str, Any], ddp_options: Mapping[str, Any]) -> dict[str, Any]:
    return wrapper_kwargs(
        strategy_kwargs,
        ddp_options,
        framework="the strategy's keyword arguments",
        set_by_framework=("module", "device_ids"),
    )


def _wrap(
    module: nn.Module,
    device_ids: list[int] | None,
    strategy_kwargs: Mapping[str, Any],
    ddp_options: Mapping[str, Any],
) -> DistributedDataParallel:
    kwargs = _options(strategy_kwargs, ddp_options)
    with _side_stream(device_ids):
        return DistributedDataParallel(module, device_ids=device_ids, **kwargs)


class GradsyncStrategy(DDPStrategy):
    """``lightning.pytorch.strategies.DDPStrategy`` that wraps with gradsync's wrapper.

    Takes every argument of ``DDPStrategy`` (its ``**kwargs`` go to the wrapper, as they go to
    torch DDP), plus ``ddp_options``: gradsync's own options (``reduction``, ``compression``,
    ``timeout``, ...). They cannot be plain keyword arguments because ``DDPStrategy`` already
    has a ``timeout`` (the process group's). Use ``Trainer(strategy=GradsyncStrategy(...))`` or,
    after importing this module, ``Trainer(strategy="gradsync")``.
    """

    def __init__(self, *args: Any, ddp_options: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ddp_options = dict(ddp_options or {})
        _options(self._ddp_kwargs, self.ddp_options)  # refuse a bad option before any launch

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        return _wrap(model, self.determine_ddp_device_ids(), self._ddp_kwargs, self.ddp_options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Not DDPStrategy's: that would re-register "ddp" and its aliases with this class.
        _register(cls, strategy_registry)


class GradsyncFabricStrategy(FabricDDPStrategy):
    """``lightning.fabric.strategies.DDPStrategy`` that wraps with gradsync's wrapper: what
    :class:`GradsyncStrategy` is to the Lightning ``Trainer``, for ``Fabric``."""

    def __init__(self, *args: Any, ddp_options: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ddp_options = dict(ddp_options or {})
        _options(self._ddp_kwargs, self.ddp_options)  # refuse a bad option before any launch

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        return _wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs, self.ddp_options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register(cls, strategy_registry)


def _register(cls: type, registry: Any) -> None:
    for name, start_method in _NAMES.items():
        if name not in registry:  # importing twice (a reload) must not fail
            registry.register(
                name,
                cls,
                description=f"gradsync DDP strategy with start_method={start_method!r}",
                start_method=start_method,
            )


GradsyncStrategy.register_strategies(StrategyRegistry)
GradsyncFabricStrategy.register_strategies(FABRIC_REGISTRY)

__all__ = ["GradsyncFabricStrategy", "GradsyncStrategy"]
