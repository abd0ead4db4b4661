"""Which live reducer carries each parameter's hooks, and the wrapper's ranks as the optimizers
below it see them.

Wrapping parameters again retires the reducer that had them (it removes its hooks): a re-wrap
works, and the old wrapper says so if it is used. The map is weak: an entry goes with its
reducer, so it never keeps a model alive.

The optimizers (``optim/``) sit below the wrapper and cannot look it up, yet ``MasterWeights``
compares its settings across the ranks of the wrapper that holds its parameters ([Note:
MasterWeights compares settings across ranks] in ``optim/master.py``). The first parameters
taken over tell ``optim/agree.py`` how to find those ranks: a registration made when a user
wraps a model, not when gradsync is imported, and removed when the last reducer that took
parameters over is collected.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.ddp.reduction import Reduction
from gradsync.failfast.deadline import Deadline
from gradsync.lifetime import HeldHooks
from gradsync.optim import agree


class Owner(Protocol):
    """What is needed of a reducer here (``reducer.py`` imports this module, not the reverse)."""

    world_size: int
    params: list[torch.nn.Parameter]
    names: list[str]
    deadline: Deadline
    reduction: Reduction

    def retire(self, by: str | None = None) -> None: ...


# id(parameter) -> the live reducer whose hooks it carries.
_owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
# agree's finder of a wrapper's ranks, registered while a reducer that took parameters over lives.
_FINDER = HeldHooks(lambda: [agree.add_peer_finder(_wrapper_peers)])


def take_over(reducer: Owner) -> None:
    """Make ``reducer`` the owner of its parameters, retiring any other that had them."""
    for p in reducer.params:
        previous = _owners.get(id(p))
        if previous is not None and previous is not reducer:  # another wrapper's: one each
            previous.retire(f"wrapped again at {_caller()}")
        _owners[id(p)] = reducer
    _FINDER.hold(reducer)


def _caller() -> str:
    """``file:line`` of the innermost frame outside gradsync: the user's wrapping call."""
    here = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"


def live_reductions() -> set[str]:
    """The reductions of the live reducers of this process (empty: no wrapper lives)."""
    return {reducer.reduction.name for reducer in list(_owners.values())}


def owner_of(params: Sequence[torch.Tensor]) -> Owner | None:
    """The live reducer that holds one of ``params``, if any."""
    return next((r for p in params if (r := _owners.get(id(p))) is not None), None)


def deadline_peers(deadline: Deadline, names: dict[int, str]) -> agree.Peers:
    """The ranks of a wrapper, compared under its deadline on its private group (see [Note:
    optimizer settings agree across ranks] in ``optim/agree.py``)."""

    def reduce_max(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=deadline.device)
        deadline.all_reduce(t, "the check that every rank steps alike", dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def gather(obj: Any) -> list[Any]:
        return deadline.gather_objects(obj, "the comparison of the ranks' optimizer steps")

    return agree.Peers(reduce_max, gather, names)


def _wrapper_peers(params: Sequence[torch.Tensor]) -> agree.Peers | None:
    """The ranks of the gradsync wrapper that holds ``params`` (its reducer's), for
    ``MasterWeights``' first-step comparison; ``None``: no wrapper, or a world of one."""
    reducer = owner_of(params)
    if reducer is None or reducer.world_size == 1:
        return None
    names = dict(zip(map(id, reducer.params), reducer.names, strict=True))
    return deadline_peers(reducer.deadline, names)
