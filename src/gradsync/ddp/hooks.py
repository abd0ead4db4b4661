"""The gradient hooks: one per trainable parameter, each telling its reducer a gradient is ready.

A hook holds its reducer weakly: a parameter's hooks live in C++, where Python's garbage
collector cannot see a cycle through them back to the module, so a strong reference would keep
a dropped wrapper's reducer alive, and acting, for as long as the model lives. A hook whose
reducer is gone does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.errors import GradsyncError
from gradsync.failfast.deadline import Deadline


class Hooked(Protocol):
    """What a hook calls: the reducer (``reducer.py``)."""

    deadline: Deadline

    def on_grad_ready(self, index: int, b: int, slot: int) -> None: ...


def hook_parameters(
    reducer: Hooked, params: Sequence[nn.Parameter], location: dict[int, tuple[int, int]]
) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on each of ``params`` (``location``: index -> (bucket, slot
    in it)) that calls ``reducer.on_grad_ready``; the handles, to remove them."""
    me = weakref.ref(reducer)
    return [
        p.register_post_accumulate_grad_hook(_grad_hook(me, i, *location[i]))
        for i, p in enumerate(params)
    ]


def _grad_hook(
    reducer: weakref.ref[Hooked], index: int, b: int, slot: int
) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        owner = reducer()
        if owner is None:
            return
        try:
            owner.on_grad_ready(index, b, slot)
        except GradsyncError as exc:
            owner.deadline.record_error(exc)  # so that the peers' timeout can name it
            raise

    return hook
