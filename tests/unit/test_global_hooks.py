"""What a wrapper installs in torch's process-wide registries (module and parameter registration
hooks, optimizer step hooks) and in the optimizers' registry of wrappers lives as long as the
last wrapper that needs it: installed while one lives, removed with the last, leaving every
registry as it was before the first."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch.nn.modules import module as torch_module

import gradsync
from gradsync.ddp import owners
from gradsync.ddp.checks import param_watch
from gradsync.optim import agree
from gradsync.timing import phases


def _registries() -> dict[str, dict[Any, Any]]:
    """A copy of every registry a wrapper may fill, by name."""
    return {
        "parameter registration": dict(torch_module._global_parameter_registration_hooks),
        "module registration": dict(torch_module._global_module_registration_hooks),
        "optimizer pre step": dict(torch_optimizer._global_optimizer_pre_hooks),
        "optimizer post step": dict(torch_optimizer._global_optimizer_post_hooks),
        "peer finders": dict(agree._FINDERS),
    }


def _ours(registries: dict[str, dict[Any, Any]]) -> dict[str, int]:
    """How many of gradsync's own hooks each registry holds."""
    mine = {param_watch._bump, phases._pre_step, phases._post_step, owners._wrapper_peers}
    return {
        name: sum(hook in mine for hook in hooks.values()) for name, hooks in registries.items()
    }


def _wrap_and_step() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _sees_a_new_parameter(model: Any) -> bool:
    """Whether a parameter registered after wrapping is noticed (through the registration
    hooks); the module is put back as it was afterwards."""
    model.module.extra = nn.Parameter(torch.zeros(1))
    seen = model.reducer.watch.changes() == ["'extra' was added"]
    del model.module.extra
    model.reducer.watch.changes()
    return seen


NONE = dict.fromkeys(_registries(), 0)
ALL = {**NONE, "parameter registration": 1, "module registration": 1}
ALL |= {"optimizer pre step": 1, "optimizer post step": 1, "peer finders": 1}


def test_a_wrapper_s_global_hooks_go_with_it(one_rank) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    before = _registries()
    assert _ours(before) == NONE, "a wrapper of an earlier test is still alive"
    model, optimizer = _wrap_and_step()
    assert _ours(_registries()) == ALL
    # The step hooks timed the step: its span waits in the recorder for the next interval.
    assert [span[0] for span in model.timeline.recorder._spans] == ["optimizer"]
    assert _sees_a_new_parameter(model)
    del model, optimizer
    gc.collect()
    assert _registries() == before


def test_hooks_stay_while_any_wrapper_lives(one_rank) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    before = _registries()
    assert _ours(before) == NONE, "a wrapper of an earlier test is still alive"
    first, first_optimizer = _wrap_and_step()
    second, second_optimizer = _wrap_and_step()
    assert _ours(_registries()) == ALL  # installed once, not once per wrapper
    del first, first_optimizer
    gc.collect()
    assert _ours(_registries()) == ALL
    assert _sees_a_new_parameter(second)
    del second, second_optimizer
    gc.collect()
    assert _registries() == before
