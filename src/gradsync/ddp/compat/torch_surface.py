"""Every member of torch's ``DistributedDataParallel``, and what gradsync's wrapper does for it.

The wrapper subclasses torch's class, so ``isinstance(model, torch.nn.parallel.
DistributedDataParallel)`` holds and code that checks it (Accelerate's ``unwrap_model`` and
``trigger_sync_in_backward``, Lightning's strategy, torch.compile's DDPOptimizer, DCP's
``state_dict`` helpers) takes its DDP path. torch's ``__init__`` never runs, so none of torch's
reducer state exists: each torch member is therefore either

- overridden by the wrapper with torch's meaning (``forward``, ``no_sync``, ``join``,
  ``join_hook``, ``register_comm_hook``, ``train``, ``_get_ddp_logging_data``, ...),
- inherited because it works unchanged on the wrapper (:data:`INHERITED`), or
- refused with a ``UsageError`` saying why and what to use instead (:data:`REFUSED`).

``tests/unit/test_torch_args.py`` checks that every member of the installed torch's class
is in one of the three, so a member a later torch adds fails the test until it is placed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from gradsync.ddp.compat import pickling
from gradsync.ddp.compat.state_keys import strip_prefixes
from gradsync.errors import UsageError

INHERITED = {
    "_active_ddp_module": "the class attribute torch.compile reads",
    "_get_active_ddp_module": "torch.compile's DDPOptimizer finds the active wrapper with it",
    "_inside_ddp_forward": "marks the wrapper active while its module runs (forward uses it)",
    "_get_data_parallel_params": "a static helper over a module's parameters",
    "_set_params_and_buffers_to_ignore_for_model": "sets torch's ignore list, which is honoured",
    "scatter": "a pure function of its arguments (torch's scatter_kwargs)",
    "gather": "a pure function of its arguments (torch's gather)",
    "_abc_impl": "Python's bookkeeping for abstract classes",
}

_REDUCER = "part of torch's C++ reducer, which gradsync replaces"
REFUSED = {
    # torch's own construction and per-step machinery: nothing outside torch calls these.
    **{
        name: _REDUCER
        for name in (
            "_register_accum_grad_hook",
            "_delayed_all_reduce_hook",
            "_register_delay_all_reduce_hook",
            "_setup_in_backward_optimizers",
            "_fire_reducer_autograd_hook",
            "_root_copy_hook",
            "_module_wait_for_copy_hook",
            "_ddp_init_helper",
            "_build_params_for_reducer",
            "_assign_modules_buffers",
            "_build_debug_param_to_name_mapping",
            "_get_parameters",
            "_run_ddp_forward",
            "_clear_grad_buffer",
            "_lazy_init",
            "_pre_forward",
            "_post_forward",
            "_check_global_requires_backward_grad_sync",
            "_check_and_sync_module_buffers",
            "_sync_final_model",
            "_match_all_reduce_for_bwd_pass",
            "_match_unused_params_allreduce",
            "_register_buffer_comm_hook",
            "_distributed_broadcast_coalesced",
            "_check_sync_bufs_post_fwd",
            "_check_sync_bufs_pre_fwd",
            "_find_common_rank",
            "_sync_buffers",
            "_sync_module_buffers",
            "_default_broadcast_coalesced",
            "_check_comm_hook",
            "_remove_autograd_hooks",
            "_check_reducer_finalized",
            "_log_and_throw",
            "_check_default_group",
            "_passing_sync_batchnorm_handle",
        )
    },
    "_register_fused_optim": "run the optimizer after backward: gradsync's reductions already "
    "overlap backward, and fusing the step into them would skip its cross-rank checks",
    "_register_builtin_comm_hook": "use register_comm_hook(state, hook) with torch's hooks, or "
    "compression='bf16' / 'fp16'",
    "_set_static_graph": "pass static_graph=True to the constructor, on every rank (settings are "
    "compared across ranks there)",
    "_set_ddp_runtime_logging_sample_rate": "gradsync has no runtime logging to sample; its "
    "bench and profiler spans measure the step",
    "_set_sparse_metadata": "sparse gradients are not supported",
    "_update_process_group": "build a new wrapper on the new group (see gradsync.elastic)",
    "_set_ddp_sink_clone": _REDUCER,
    "to_kwargs": "inputs are moved to device_ids[0] by the forward itself",
    "_distributed_rank": "use torch.distributed.get_rank(model.process_group)",
}


def _refusal(name: str, instead: str) -> Callable[..., Any]:
    def refuse(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"torch DDP's {name} is not available on a gradsync wrapper: {instead}")

    refuse.__name__ = name
    return refuse


class TorchSurface:
    """The refusals, as methods (a property for ``_distributed_rank``), mixed into the wrapper
    ahead of torch's class so that they shadow torch's members of the same names."""

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging record, with the fields other libraries read (Lightning:
        ``can_set_static_graph``)."""
        wrapper: Any = self
        return {
            "can_set_static_graph": False,
            "static_graph": int(wrapper.static_graph),
            "find_unused_parameters": int(wrapper.find_unused_parameters),
            "gradient_as_bucket_view": int(wrapper.gradient_as_bucket_view),
            "bucket_cap_bytes": wrapper.bucket_bytes_cap,
            "world_size": dist.get_world_size(wrapper.process_group),
            "device_ids": ",".join(map(str, wrapper.device_ids or [])),
            "backend_name": "gradsync",
        }

    @property
    def bucket_bytes_cap(self) -> int:
        """The cap in bytes, as torch DDP names it (torch.compile's DDPOptimizer reads it)."""
        cap = self.bucket_cap_mb  # type: ignore[attr-defined]
        return 2**62 if cap is None or cap == math.inf else int(cap * 2**20)

    # torch's Joinable interface, for torch.distributed.algorithms.join.Join (see join.py)
    def join_hook(self, **kwargs: Any) -> JoinHook:
        state: Any = self._state  # type: ignore[attr-defined]
        return state.join.torch_hook(state, self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device  # type: ignore[attr-defined]

    @property
    def join_process_group(self) -> Any:
        return self.process_group  # type: ignore[attr-defined]

    def will_sync_module_buffers(self) -> bool:
        wrapper: Any = self
        syncing = wrapper.require_forward_param_sync and wrapper.broadcast_buffers
        ignore = wrapper.parameters_to_ignore
        return bool(syncing and any(n not in ignore for n, _ in wrapper.module.named_buffers()))

    # checkpoints: keys are the unwrapped module's, as torch DDP users' loaders expect
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._parameters_ready()
        module: nn.Module = self.module  # type: ignore[attr-defined]
        return module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        self._parameters_ready()  # a pending all-gather would overwrite what is loaded
        module: nn.Module = self.module  # type: ignore[attr-defined]
        own_keys = module.state_dict(keep_vars=True).keys()
        return module.load_state_dict(
            strip_prefixes(state_dict, own_keys), strict=strict, assign=assign
        )

    def _parameters_ready(self) -> None:
        """Wait for a sharded optimizer's all-gathers in flight; an unpickled wrapper not built
        yet has none (and is not built for it)."""
        state = self.__dict__.get("_state")
        if state is not None:
            state.parameters_ready()

    def train(self, mode: bool = True) -> Any:
        return nn.Module.train(self, mode)  # type: ignore[type-var]

    # pickling, as torch DDP allows: [Note: a pickled wrapper] in pickling.py
    def __getstate__(self) -> dict[str, Any]:
        wrapper: Any = self
        state = {"module": wrapper.module, "training": wrapper.training}
        if pickling.LOADED in self.__dict__:  # not built since it was loaded: as it was
            return {**state, "arguments": self.__dict__[pickling.LOADED]}
        arguments = self.__dict__[pickling.ARGS]
        mid_step = wrapper.reducer.window.open  # a training forward since the last reduction
        sharded = self._state.sharded is not None  # type: ignore[attr-defined]
        hooked = self._state.torch_hook is not None  # type: ignore[attr-defined]
        pickling.check_picklable(arguments, sharded, hooked, mid_step)
        return {**state, "arguments": arguments}

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # type: ignore[arg-type]
        self.add_module("module", state["module"])  # type: ignore[attr-defined]
        self.train(state["training"])
        self.__dict__[pickling.LOADED] = state["arguments"]

    def _build_if_loaded(self) -> bool:
        """Build an unpickled wrapper now, a collective; ``False`` if it is built already."""
        arguments = self.__dict__.pop(pickling.LOADED, None)
        if arguments is None:
            return False
        training, sync = self.training, self.__dict__.get("_sync_backward", True)  # type: ignore[attr-defined]
        init: Any = type(self).__init__
        init(self, self.module, **arguments)  # type: ignore[attr-defined]
        self.train(training)
        self._sync_backward = sync  # require_backward_grad_sync, if set since loading
        return True

    if not TYPE_CHECKING:  # at run time only: to mypy, a missing attribute stays an error

        def __getattr__(self, name: str) -> Any:
            try:
                return nn.Module.__getattr__(self, name)
            except AttributeError:
                if not self._build_if_loaded():
                    raise
            return getattr(self, name)  # built: the wrapper's own member


for _name, _instead in REFUSED.items():
    _method = _refusal(_name, _instead)
    setattr(TorchSurface, _name, property(_method) if _name == "_distributed_rank" else _method)
