"""The check behind ZeRO-1 in the deterministic mode (``gradsync/optim/piecewise.py``): an
optimizer stepping a tensor cut into pieces must give every element the bits the whole
tensor's step gives it. The elementwise CPU kernels pass; torch's fused CPU kernels, whose
scalar tail rounds another way than their vectorised body, are caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsync.optim.piecewise import piecewise_mismatch

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("optimizer", "settings"),
    [
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elementwise_kernels_step_a_piece_to_the_whole_tensors_bits(
    optimizer: type[torch.optim.Optimizer], settings: dict[str, Any], dtype: torch.dtype
) -> None:
    assert piecewise_mismatch(optimizer, settings, dtype, CPU) is None


@pytest.mark.parametrize(
    ("optimizer", "settings"),
    [
        (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
        (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
    ],
)
def test_fused_cpu_kernels_are_caught(
    optimizer: type[torch.optim.Optimizer], settings: dict[str, Any]
) -> None:
    why = piecewise_mismatch(optimizer, settings, torch.float32, CPU)
    assert why is not None and "changed the bits of" in why and "float32" in why, why


class _Broken(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("no step today")


def test_an_optimizer_that_raises_is_a_mismatch_not_a_crash() -> None:
    why = piecewise_mismatch(_Broken, {"lr": 0.1}, torch.float32, CPU)
    assert why == "stepping a probe raised RuntimeError: no step today"
