"""Nothing of gradsync keeps a wrapped model alive: once the user drops the wrapper and the
module, both are garbage, and the threads they started have ended, whatever features were on (a
job that re-wraps, or a notebook, would otherwise leak whole models and a thread per wrapper)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from gradsync.comm import PowerSGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: nn.Module, steps: int = 2) -> None:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(torch.ones(4, 8)).sum().backward()


def _collected(build: Callable[[nn.Module], nn.Module]) -> tuple[bool, bool, list[str]]:
    """Wrap a fresh module with ``build``, train it, drop both; (module gone, wrapper gone,
    the threads they started that are still running 5 s later)."""
    before = set(threading.enumerate())
    module = _model()
    wrapper = build(module)
    _train(wrapper)
    module_ref, wrapper_ref = weakref.ref(module), weakref.ref(wrapper)
    started = set(threading.enumerate()) - before
    del module, wrapper
    gc.collect()
    for thread in started:
        thread.join(timeout=5.0)
    running = sorted(t.name for t in started if t.is_alive())
    return module_ref() is None, wrapper_ref() is None, running


def _sharded(module: nn.Module) -> nn.Module:
    model = gradsync.DistributedDataParallel(module)
    model.shard_optimizer(torch.optim.SGD, lr=0.1)
    return model


def _torch_hook(module: nn.Module) -> nn.Module:
    model = gradsync.DistributedDataParallel(module)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


BUILDS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "default": lambda m: gradsync.DistributedDataParallel(m),
    "bf16": lambda m: gradsync.DistributedDataParallel(m, compression="bf16"),
    "main grads": lambda m: gradsync.DistributedDataParallel(m, main_grad_dtype=torch.float64),
    # Two steps: "auto" is still profiling, its timing hooks on every parameter.
    "auto": lambda m: gradsync.DistributedDataParallel(m, bucket_cap_mb="auto"),
    "shard_optimizer": _sharded,
    "register_comm_hook": _torch_hook,
    # These two run their all-reduces on a thread of their own (PowerSGD too: below).
    "ring": lambda m: gradsync.DistributedDataParallel(m, algorithm="ring"),
    "hierarchical": lambda m: gradsync.DistributedDataParallel(m, algorithm="hierarchical"),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_dropped_wrapper_and_module_are_collected(one_rank, name: str) -> None:  # type: ignore[no-untyped-def]
    assert _collected(BUILDS[name]) == (True, True, [])


def test_a_powersgd_object_serves_a_new_model_once_the_old_one_is_gone(one_rank) -> None:  # type: ignore[no-untyped-def]
    powersgd = PowerSGD(rank=1, start_iter=0)
    build = lambda m: gradsync.DistributedDataParallel(m, compression=powersgd)  # noqa: E731
    assert _collected(build) == (True, True, [])
    _train(build(_model()))  # before the fix: "already serves another live model"


def test_a_rewrapped_module_lives_on_in_its_new_wrapper(one_rank) -> None:  # type: ignore[no-untyped-def]
    module = _model()
    old = gradsync.DistributedDataParallel(module)
    _train(old)
    old_ref = weakref.ref(old)
    new = gradsync.DistributedDataParallel(module)  # retires the old wrapper's hooks
    del old
    gc.collect()
    assert old_ref() is None
    _train(new)
    assert new.reducer.num_reductions == 2
