"""What a training step changes, kept so that the step can be redone from its start.

[Note: rolling a step back]
A rank can be lost at any point of a step, and the survivors are not all at the same point:
one may have seen the last bucket's all-reduce complete and stepped its optimizer, another
raised inside that all-reduce; one may even have finished the step and begun the next. The
survivors go back to the start of the earliest step any of them had not finished, and redo it
over the same global batch (``membership.py`` says which step that is). Two records make that
possible without a copy of the model at every step start:

- :class:`StepStart`, taken when each step begins: the small state a step changes (the data
  position, the LR scheduler, the optimizer's hyperparameters, the module's buffers, the RNG).
  The last two are kept: a rank that finished step ``k`` goes back to ``k``'s start.
- :class:`UndoLog`: the parameters and the optimizer's state, copied by an optimizer step
  pre-hook just before ``optimizer.step()`` changes them, once per step. Between two optimizer
  steps the parameters do not change (the all-reduce writes gradients), so a rank that has not
  stepped in the step being redone has nothing to undo, and one that has undoes its one step.
  No rank can be past two optimizer steps: the next step's all-reduce needs every survivor.

The undo copy costs one pass over the parameters and the optimizer state per step, and as
much memory again: the price of redoing a step exactly rather than averaging over whoever is
left.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.recovery.membership import NoRecoveryError


@dataclass
class StepStart:
    """The small state at the start of a step."""

    position: dict[str, int]  # the sampler's state_dict
    scheduler: dict[str, Any] | None
    hyperparameters: list[dict[str, Any]]  # the optimizer's param_groups, without the params
    buffers: list[torch.Tensor]
    rng: torch.Tensor

    @classmethod
    def take(
        cls, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any
    ) -> StepStart:
        groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups
        ]
        return cls(
            position=dict(sampler.state_dict()),
            scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            hyperparameters=groups,
            buffers=[b.detach().clone() for b in module.buffers()],
            rng=torch.get_rng_state(),
        )

    def restore(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any
    ) -> None:
        sampler.load_state_dict(self.position)
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        for group, saved in zip(optimizer.param_groups, self.hyperparameters, strict=True):
            group.update(copy.deepcopy(saved))
        with torch.no_grad():
            for buffer, kept in zip(module.buffers(), self.buffers, strict=True):
                buffer.copy_(kept)
        torch.set_rng_state(self.rng)


class UndoLog:
    """The parameters and optimizer state as they were before this step's ``optimizer.step()``.

    ``step`` (set by the owner before each training step) names the step the copy belongs
    to; :meth:`undo` puts it back if the copy is of the step being redone.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.step = -1  # the training step now running (the owner sets it)
        self.taken_in: int | None = None  # the training step whose optimizer step is logged
        self._params: list[torch.Tensor] = []
        self._state: dict[torch.Tensor, dict[str, Any]] = {}
        self._handle = optimizer.register_step_pre_hook(lambda *_: self._before_step())

    def _params_of(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _before_step(self) -> None:
        if self.taken_in == self.step:  # a second optimizer step in one step: keep the first
            return
        params = self._params_of()
        with torch.no_grad():
            if len(self._params) != len(params):
                self._params = [p.detach().clone() for p in params]
            else:
                for saved, p in zip(self._params, params, strict=True):
                    saved.copy_(p)
            self._state = {
                p: _copy_state(self.optimizer.state.get(p, {}), self._state.get(p)) for p in params
            }
        self.taken_in = self.step

    def undo(self, step: int) -> bool:
        """Put back the parameters and optimizer state of before step ``step``'s optimizer
        step, if this rank took it; ``False`` if it had not stepped in ``step``."""
        if self.taken_in is None or self.taken_in < step:
            return False
        if self.taken_in > step:  # cannot happen: the step after needs every survivor
            raise NoRecoveryError(
                f"this rank stepped its optimizer in step {self.taken_in}, past step {step} "
                "that the survivors redo: it cannot go back two optimizer steps"
            )
        with torch.no_grad():
            for p, saved in zip(self._params_of(), self._params, strict=True):
                p.copy_(saved)
        for p, state in self._state.items():
            if state:
                self.optimizer.state[p] = _copy_state(state, None)
            else:
                self.optimizer.state.pop(p, None)
        self.taken_in = None
        return True

    def remove(self) -> None:
        self._handle.remove()


def _copy_state(state: dict[str, Any], into: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of one parameter's optimizer state, reusing ``into``'s tensors where they fit."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            old = None if into is None else into.get(key)
            if isinstance(old, torch.Tensor) and _fits(old, value):
                out[key] = old.copy_(value)
            else:
                out[key] = value.detach().clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


def _fits(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` can be copied into ``old``'s memory as it is."""
    return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
