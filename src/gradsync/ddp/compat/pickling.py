"""A pickled wrapper: ``torch.save(model)`` and ``copy.deepcopy(model)``, as torch DDP allows.

[Note: a pickled wrapper]
torch's DDP pickles its attributes without the process group and the reducer, and unpickling
builds a new reducer over the default group, which must exist by then; no collective runs.
gradsync's wrapper holds more that belongs to one job and one process (a private process
group, arrival records in the job's store, autograd hooks, the step window), and building one
is a collective: every rank compares replicas and settings and joins a new private group. So a
pickle holds what the constructor was given (the module and the arguments), and an unpickled
wrapper is *loaded* (``Lifecycle.LOADED``): its module, not yet built. It is built at its
first use that involves the ranks, exactly as a new wrapper with those arguments would be: a
forward with gradients enabled, or any member of gradsync's own (``no_sync()``, ``join()``,
``bucket_specs``, ...), on every rank together. Until then it is its module: ``.module``,
``state_dict()``, ``parameters()``, ``eval()`` and forwards without gradients work with no
process group at all, which is what loading a whole saved wrapper for evaluation in one
process needs (torch's unpickling raises there).

Refused, naming what to save instead (the module, or its ``state_dict()``): a wrapper given a
``process_group`` other than the default one or a ``device_mesh`` (torch refuses a
non-default group too: the loading process could not find it again); state that belongs to
this job, ``shard_optimizer()`` (the optimizer holds the shards) and a torch comm hook (its
state may hold a process group); and a wrapper inside a step, between a forward and its
synchronised backward, whose accumulated gradients a pickle would not carry. A ``PowerSGD``
object travels with the arguments, with its state, so a copy continues as the original would.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from gradsync.errors import UsageError

ARGS = "_constructed_with"  # the constructor's arguments, kept for pickling
LOADED = "_loaded_with"  # present while an unpickled wrapper is not built yet

_INSTEAD = "save or copy model.module (or its state_dict()) and wrap it again"


def remember_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate ``__init__`` so that the wrapper keeps the arguments it was constructed with."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs).arguments
        init(self, *args, **kwargs)
        self.__dict__[ARGS] = {k: v for k, v in arguments.items() if k not in ("self", "module")}

    return wrapped


def check_picklable(arguments: dict[str, Any], sharded: bool, hooked: bool, mid_step: bool) -> None:
    """Refuse to pickle a wrapper built with ``arguments`` that cannot be rebuilt from them."""
    group = arguments.get("process_group")
    why = None
    if group is not None and group is not dist.group.WORLD:
        why = "it was given a process_group of its own, which the loading process cannot find"
    elif arguments.get("device_mesh") is not None:
        why = "it was given a device_mesh, which the loading process cannot find"
    elif sharded:
        why = "shard_optimizer() was called (the optimizer holds this job's shards)"
    elif hooked:
        why = "a comm hook is registered (its state may hold this job's process group)"
    elif mid_step:
        why = "it is inside a step (its accumulated gradients would not be carried)"
    if why is not None:
        raise UsageError(
            f"this gradsync wrapper cannot be pickled or deep-copied: {why}; {_INSTEAD}"
        )
