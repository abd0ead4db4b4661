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


class MasterWeights:
    """``optimizer_class(fp32 copies of params, **defaults)``, stepped on ``p.main_grad``.

    A parameter without ``.grad`` after the backward (unused on every rank) is skipped, as a
    torch optimizer skips it. ``state_dict()`` holds the inner optimizer's state and the fp32
    weights, so a checkpoint resumes exactly, not from the rounded bf16 ones.
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
        for p, m in zip(self.params, self.master, strict=True):
            p.grad = None
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach().clone() for m in self.master],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for m, saved, p in zip(self.master, state["master"], self.params, strict=True):
            m.copy_(saved)
            p.copy_(saved)
