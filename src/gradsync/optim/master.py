"""fp32 master weights for a low-precision model: the optimizer half of mixed precision.

Pairs with ``DistributedDataParallel(model, main_grad_dtype=torch.float32)`` (see [Note: main
gradients] in ``gradsync/ddp/main_grads.py``). The model's parameters stay bf16 (what the
forward and backward compute with); this keeps an fp32 copy of each, steps the given optimizer
on those copies with each parameter's fp32 ``main_grad``, and rounds the result into the model.
Without it an optimizer stepping bf16 parameters loses every update smaller than half a bf16
step of the weight (e.g. ``lr * update < 2**-9 * |w|``): late in training, most of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradsync.errors import CheckpointError


class MasterWeights:
    """``optimizer_class(fp32 copies of params, **defaults)``, stepped on ``p.main_grad``.

    A parameter without ``.grad`` after the backward (unused on every rank) is skipped, as a
    torch optimizer skips it. ``state_dict()`` holds the inner optimizer's state and the fp32
    weights, so a checkpoint resumes exactly, not from the rounded bf16 ones;
    :class:`gradsync.checkpoint.Checkpointer` saves it keyed by parameter name
    (:meth:`named_state_dict`).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        **defaults: Any,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [
            torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params
        ]
        self.optimizer = optimizer_class(self.master, **defaults)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        stepped_params: list[torch.Tensor] = []
        stepped_master: list[torch.Tensor] = []
        for p, m in zip(self.params, self.master, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            main = getattr(p, "main_grad", None)
            m.grad = main if main is not None and main.dtype == m.dtype else p.grad.float()
            stepped_params.append(p)
            stepped_master.append(m)
        self.optimizer.step()
        if stepped_params:
            torch._foreach_copy_(stepped_params, stepped_master)  # rounds to the model's dtype

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's ``.grad`` set to ``None`` or zeroed, as a torch optimizer does. The
        masters' ``.grad`` is always dropped: :meth:`step` points it at ``main_grad`` anew."""
        for p, m in zip(self.params, self.master, strict=True):
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach().clone() for m in self.master],
        }

    def named_state_dict(self, names: list[str]) -> dict[str, Any]:
        """The state keyed by parameter name (``names[i]`` is ``params[i]``'s), in the form of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` plus the fp32
        weights under ``"master"``: what DCP saves, and the live tensors DCP loads into.

        As torch's function does, an optimizer that has not stepped yet gets its state first
        (one step on zero gradients at lr 0, which moves no weight), so that a checkpoint
        holds the same keys whenever it is taken and a load has tensors to fill.
        """
        self._initialise_state()
        inner = self.optimizer.state_dict()  # state keyed by index, in param_groups' order
        order = self._names_in_order(names)
        return {
            "state": {order[i]: value for i, value in inner["state"].items()},
            "param_groups": [
                {**group, "params": [order[i] for i in group["params"]]}
                for group in inner["param_groups"]
            ],
            "master": {name: m.data for name, m in zip(names, self.master, strict=True)},
        }

    @torch.no_grad()
    def load_named_state_dict(self, state: dict[str, Any], names: list[str]) -> None:
        """Load what :meth:`named_state_dict` gave (after DCP filled it), and round the fp32
        weights into the model. The parameter groups must list the same names in the same
        order as this optimizer's (the same model and optimizer construction)."""
        saved = [name for group in state["param_groups"] for name in group["params"]]
        live = self._names_in_order(names)
        if saved != live:
            raise CheckpointError(
                "the checkpoint's MasterWeights hold other parameters, or in another order, "
                f"than this one: {saved[:4]}... against {live[:4]}..."
            )
        index = {name: i for i, name in enumerate(saved)}
        self.optimizer.load_state_dict(
            {
                "state": {index[name]: value for name, value in state["state"].items()},
                "param_groups": [
                    {**group, "params": [index[n] for n in group["params"]]}
                    for group in state["param_groups"]
                ],
            }
        )
        for m, p, name in zip(self.master, self.params, names, strict=True):
            m.copy_(state["master"][name])
            p.copy_(m)

    def _names_in_order(self, names: list[str]) -> list[str]:
        by_id = {id(m): name for m, name in zip(self.master, names, strict=True)}
        return [by_id[id(m)] for group in self.optimizer.param_groups for m in group["params"]]

    @torch.no_grad()
    def _initialise_state(self) -> None:
        if self.optimizer.state:
            return
        groups = self.optimizer.param_groups
        lrs = [group.get("lr") for group in groups]
        for group in groups:
            if "lr" in group:  # an optimizer without one is left as it is, as torch does
                group["lr"] = 0.0
            for m in group["params"]:
                m.grad = torch.zeros_like(m)
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, lrs, strict=True):
                if "lr" in group:
                    group["lr"] = lr
                for m in group["params"]:
                    m.grad = None

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for m, saved, p in zip(self.master, state["master"], self.params, strict=True):
            m.copy_(saved)
            p.copy_(saved)
