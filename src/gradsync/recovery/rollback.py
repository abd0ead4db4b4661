"""What a training step changes, kept so that the step can be redone from its start.

[Note: rolling a step back]
A rank can be lost at any point of a step, and the survivors are not all at the same point:
one may have seen the last bucket's all-reduce complete and stepped its optimizer, another
raised inside that all-reduce; one may even have finished the step and begun the next. The
survivors go back to the start of the earliest step any of them had not finished, and redo it
over the same global batch (``membership.py`` says which step that is). No copy of the model
is kept for it, because the parameters and the optimizer state change in one place only:
``optimizer.step()``, which issues no collective.

- :class:`StepStart`, taken when each step begins, is the small state a step changes besides
  them (the data position, the LR scheduler, the optimizer's hyperparameters, the module's
  buffers, the RNG). The last two are kept: a rank that finished step ``k`` goes back to
  ``k``'s start.
- :class:`OptimizerSteps` records the step in which the optimizer last stepped. Each survivor
  reports it at the agreement, and for the step ``k`` being redone there are two cases:

  1. *No survivor stepped in* ``k``. Every survivor's parameters and optimizer state are still
     those of ``k``'s start: the step is redone as it is.
  2. *Some survivor stepped in* ``k``. Its all-reduce had every rank's gradients, the dead
     one's included, so its update is the step's exact result. It sends its parameters and
     optimizer state to the survivors that had not stepped (only when the loss split them),
     and the step is *replayed*: redone from its start with the same data, but with
     ``optimizer.step()`` skipped, so that what the loop does around it (the scheduler's step,
     a save, a logged loss) happens once, as in a step that was never interrupted.

  No rank can have stepped in ``k + 1``: that step's all-reduce needs every survivor, and one
  of them had not finished ``k``.

The price: one optimizer step per step (a second in the same step is refused), and a replayed
step redoes its forward and backward for nothing but the loop's own work around the optimizer
step, as a redone step does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.errors import UsageError
from gradsync.recovery.membership import NoRecoveryError, Report


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


class OptimizerSteps:
    """In which training step the optimizer last stepped, and the skipping of its step while a
    step is replayed ([Note: rolling a step back]).

    ``step`` names the training step now running (``begin``), ``None`` between steps: an
    optimizer step outside ``with step:`` is the loop's own business.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.step: int | None = None  # the training step now running
        self.stepped_in: int | None = None  # the training step of the last optimizer step
        self.replay: int | None = None  # the step to run with optimizer.step() skipped
        self._skipping: tuple[Any] | None = None  # what the skip replaced: (instance step,)
        self._counted = False  # whether the optimizer step under way is one of the loop's
        # On a mesh, a collective before each of the loop's optimizer steps, and the step's
        # gradients kept from it ([Note: a mesh under Recovery] in replicas.py)
        self.commit: Callable[[int], object] | None = None
        self._committing: tuple[int, list[torch.Tensor | None]] | None = None
        self._handles = [
            optimizer.register_step_pre_hook(lambda *_: self._before_step()),
            optimizer.register_step_post_hook(lambda *_: self._after_step()),
        ]

    def _before_step(self) -> None:
        self._counted = self.step is not None and not _creates_state(self.optimizer)
        if self._counted and self.stepped_in == self.step:
            raise UsageError(
                f"the optimizer stepped twice in step {self.step}: Recovery redoes a step "
                "exactly only with one optimizer.step() per step"
            )
        if self._counted and self.commit is not None:
            assert self.step is not None
            self._committing = (self.step, [p.grad for p in self._params()])
            self.commit(self.step)

    def _after_step(self) -> None:
        if self._counted:
            self.stepped_in, self._committing = self.step, None

    def begin(self, step: int) -> None:
        """Step ``step`` begins: skip its optimizer step if it is the one to replay."""
        self.end()
        self.step, self._committing = step, None
        if self.replay == step:
            # An instance attribute shadows the class's step for this object only, and is found
            # by every caller (an LR scheduler's wrapper, GradScaler.step) at call time.
            self._skipping = (vars(self.optimizer).get("step"),)
            self.optimizer.step = _skipped  # type: ignore[method-assign,assignment]

    def end(self) -> None:
        """The step is over (completed or interrupted); if it was replayed, the optimizer steps
        again."""
        self.step = None
        if self._skipping is None:
            return
        (replaced,) = self._skipping
        if replaced is None:
            del self.optimizer.step
        else:
            self.optimizer.step = replaced  # type: ignore[method-assign]
        self._skipping = None

    def settle(
        self, target: int, reports: Mapping[int, Report], order: Iterable[int], module: nn.Module
    ) -> None:
        """After the regroup to the members ``order`` (ranks before, in new rank order), with
        their ``reports``: step ``target``'s result, where a member holds it, on every member,
        and the step marked to replay; else the step is redone as it is."""
        order = list(order)
        holder = holder_of(target, reports, order)
        self.replay = None if holder is None else target
        if holder is None:
            return
        if self.commit is not None:  # every member got past the commit or entered it
            if self.stepped_in != target:
                self._step_from_commit(target)
        elif any(reports[r].stepped != target for r in order):  # the loss split them
            share_step_result(module, self.optimizer, holder, self.stepped_in != target)
        self.stepped_in = target

    def _step_from_commit(self, target: int) -> None:
        """Another member got past step ``target``'s commit, so this one entered it with the
        step's gradients: the optimizer steps from them now, as it would have."""
        if self._committing is None or self._committing[0] != target:
            raise NoRecoveryError(
                f"a survivor stepped its optimizer in step {target}, but this rank did not "
                "reach that step's commit: the step's result is not on every rank"
            )
        params, (_, grads) = self._params(), self._committing
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        try:
            self.optimizer.step()  # outside a step of the loop: no commit, not counted
        finally:
            for p in params:
                p.grad = None
            self._committing = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def remove(self) -> None:
        self.end()
        for handle in self._handles:
            handle.remove()


def _creates_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer step about to run only creates the optimizer's state: no state
    yet and every learning rate 0, as torch's DCP steps an optimizer to have a state to save
    (``get_state_dict``). It changes no parameter: it is not the loop's step."""
    rates = [g["lr"] for g in optimizer.param_groups if "lr" in g]
    return not optimizer.state and bool(rates) and all(float(lr) == 0 for lr in rates)


def _skipped(closure: Callable[[], Any] | None = None) -> None:
    """``optimizer.step`` while a step is replayed: its update is already in the parameters."""
    return None


def holder_of(target: int, reports: Mapping[int, Report], order: Iterable[int]) -> int | None:
    """The first member in ``order`` (ranks before the change, in new rank order) that stepped
    its optimizer in step ``target``, or ``None``; raise if one stepped past it."""
    ahead = {r: rep.stepped for r, rep in reports.items() if (rep.stepped or -1) > target}
    if ahead:
        raise NoRecoveryError(
            f"rank(s) {sorted(ahead)} stepped their optimizer past step {target} that the "
            "survivors redo: a step's result cannot be taken back"
        )
    return next((i for i, r in enumerate(order) if reports[r].stepped == target), None)


def share_step_result(
    module: nn.Module, optimizer: torch.optim.Optimizer, holder: int, receive: bool
) -> None:
    """The parameters of the rank ``holder`` of the default group on every rank, and its
    optimizer state loaded where ``receive`` (the ranks that stepped hold it already)."""
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p, group_src=holder)
    sent: list[Any] = [None if receive else optimizer.state_dict()]
    dist.broadcast_object_list(sent, group_src=holder)
    if receive:
        optimizer.load_state_dict(sent[0])
