"""What a checkpoint may hold: only what ``torch.load(..., weights_only=True)`` gives back.

``torch.save`` pickles anything, but the safe loader refuses every class outside a short
allowlist (a NumPy array, an ``argparse.Namespace``, a ``defaultdict``, a ``frozenset``). A
save that succeeds today and fails at resume time is worse than no save, so the savers walk
the object first and refuse it, naming the key at fault. The walk is a pass over containers and
leaves; tensors are not read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from gradsync.errors import UsageError

# Leaves the weights_only unpickler of torch >= 2.4 accepts (checked in tests/unit).
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.Size,
    torch.dtype,
    torch.device,
)
_HINTS = {
    "ndarray": "convert it with torch.from_numpy(...) or .tolist()",
    "Namespace": "save vars(args), a dict, instead",
    "defaultdict": "save dict(...) instead",
    "frozenset": "save a set or a sorted list instead",
}


def check_loadable(obj: Any, where: str, *, key: str = "obj", any_tensor: bool = False) -> None:
    """Raise :class:`~gradsync.errors.UsageError` naming the first value under ``obj`` that
    ``torch.load(..., weights_only=True)`` would refuse. ``where`` says what is being saved;
    ``any_tensor`` accepts tensor subclasses (DCP writes those itself, without pickling)."""
    problem = find_unloadable(obj, key, any_tensor=any_tensor)
    if problem is not None:
        key, value = problem
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        hint = _HINTS.get(
            type(value).__name__, "save tensors, numbers, strings and plain containers"
        )
        raise UsageError(
            f"{where}: {key} is a {kind}, which torch.load(..., weights_only=True) refuses, so "
            f"this checkpoint could not be loaded back safely; {hint}"
        )


def find_unloadable(
    obj: Any, key: str = "obj", *, any_tensor: bool = False
) -> tuple[str, Any] | None:
    """``(key path, value)`` of the first value the safe loader refuses, or ``None``."""
    stack: list[tuple[str, Any]] = [(key, obj)]
    while stack:
        path, value = stack.pop()
        kind = type(value)
        if kind in (torch.Tensor, torch.nn.Parameter) or kind in _LEAVES:
            continue
        if any_tensor and isinstance(value, torch.Tensor):
            continue
        if kind in (dict, OrderedDict):
            for k, v in reversed(list(value.items())):
                if type(k) not in _LEAVES:
                    return f"{path} key {k!r}", k
                stack.append((f"{path}[{k!r}]", v))
        elif kind in (list, tuple, set):
            items = list(value) if kind is not set else sorted(value, key=repr)
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(items))))
        else:
            return path, value
    return None
