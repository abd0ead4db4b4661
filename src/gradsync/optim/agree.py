"""Ranks that step one optimizer together must step it alike: checked before each step.

[Note: optimizer settings agree across ranks]
A sharded optimizer steps each rank's slice of the parameters with that rank's
hyper-parameters, and the all-gather that follows copies every slice everywhere. So a learning
rate that differs on one rank (a rank-dependent config, an LR scheduler stepped on some ranks
only) leaves no trace in the replicas, which stay bit-identical: each slice of the model
silently trains at another rate. A ``.grad`` cleared on one rank only (``zero_grad()`` inside
an ``if rank == 0``) drops that rank's slice of the update the same way. Replicated optimizers
(``MasterWeights``) diverge visibly instead, but only to ``check_replicas()``.

So before a step every rank describes what it is about to do: the optimizer class, every
param group's settings (everything but ``"params"``, tensors by value) and which parameters
have a ``.grad``; and a 62-bit hash of that description, the *fingerprint*, is compared in
one all-reduce (``MAX`` of ``[fingerprint, -fingerprint, refused]``: the ranks agree exactly
when the maximum of the fingerprint is minus the maximum of its negation). The same
all-reduce carries whether a local check refused the step on some rank, so that every rank
raises instead of the others waiting in the parameter all-gather. Only on a disagreement are
the descriptions themselves gathered, to name the setting, the values and the ranks; every
rank raises the same :class:`~gradsync.errors.UsageError` (or the refusing rank's error),
before anything is stepped.

Why a collective of its own: the step's one collective, the parameter all-gather, comes after
the step, too late to refuse it; the gradient reduction comes before it, but a loop may still
change the settings after the backward (a warm-up that sets ``group["lr"]`` just before
``step()``), and it belongs to the reducer, which knows nothing of optimizers.

Cost, measured under torchrun on loopback (gloo, 2 ranks, a GPT of 48 parameters): 0.02 ms to
describe and hash, 0.35 ms for the all-reduce; 0.1-0.3 % of that model's step (figures in
``docs/zero.md``). A sharded optimizer checks at every step, because a later change on one rank
would stay hidden too; ``MasterWeights`` at its first step only (a later one shows in the
replicas). On NCCL the result is read on the host: one synchronisation per step.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from gradsync import errors
from gradsync.errors import GradsyncError, UsageError

ReduceMax = Callable[[list[int]], list[int]]
"""The elementwise maximum over the ranks of a few int64 (a collective on every rank)."""

GatherObjects = Callable[[Any], list[Any]]
"""Every rank's object, in rank order (a collective on every rank)."""

_MASK = (1 << 62) - 1  # fingerprints fit in an int64 with their negation


@dataclass(frozen=True)
class Peers:
    """The other ranks that step the same optimizer, and how to compare with them."""

    reduce_max: ReduceMax
    gather: GatherObjects
    names: Mapping[int, str] = field(default_factory=dict)  # parameter names by id, for messages


def dist_peers(group: dist.ProcessGroup | None, device: torch.device) -> Peers:
    """Peers over ``group`` with torch.distributed's own collectives (no deadline): a
    standalone ``ShardedOptimizer``'s."""

    def reduce_max(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in t.tolist()]

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return Peers(reduce_max, gather)


PeerFinder = Callable[[Sequence[torch.Tensor]], "Peers | None"]
# By the id of the handle that removes each (an OrderedDict, as torch's hook registries: a
# RemovableHandle refers to its registry weakly, and a plain dict cannot be).
_FINDERS: OrderedDict[int, PeerFinder] = OrderedDict()


def add_peer_finder(finder: PeerFinder) -> RemovableHandle:
    """How a data-parallel wrapper tells the optimizers here, which sit below it and cannot
    look it up, over which ranks it replicates some parameters (``ddp/owners.py`` adds the
    gradsync wrapper's): ``finder(params)`` gives the :class:`Peers`, or ``None``. The wrapper
    removes it with the handle returned (as torch's hooks) when its last model goes."""
    handle = RemovableHandle(_FINDERS)
    _FINDERS[handle.id] = finder
    return handle


def peers_of(params: Sequence[torch.Tensor]) -> Peers | None:
    """The peers of a replicated optimizer of ``params`` (``None``: no wrapper holds them, or
    it has one rank)."""
    finders = list(_FINDERS.values())
    return next((peers for f in finders if (peers := f(params)) is not None), None)


MAX_LINES = 6  # differences named in one error


@dataclass(frozen=True)
class StepDescription:
    """What one rank is about to step: gathered only when the fingerprints differ."""

    optimizer: str
    groups: tuple[tuple[tuple[str, str], ...], ...]  # per group: (setting, repr of its value)
    has_grad: bytes  # one byte per parameter of param_groups, in order (b"" if not compared)
    labels: tuple[str, ...]  # per parameter: how an error names it
    refused: tuple[str, str] | None = None  # (error class name, message) of a local check

    def fingerprint(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.optimizer, self.groups)).encode())
        h.update(self.has_grad)
        return int.from_bytes(h.digest(), "little") & _MASK


def _plain(value: Any) -> Any:
    """``value`` in a form whose ``repr`` is the same on every rank for equal settings: a tensor
    (a learning rate may be one) by value, not with its device."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    return value


def describe(
    optimizer: str, param_groups: Sequence[Mapping[str, Any]], *, grads: bool = True
) -> StepDescription:
    """This rank's :class:`StepDescription` (its parameters not labelled yet: that is only
    needed for a message). ``grads``: compare which parameters have a ``.grad`` (``False``
    where the step does not read ``.grad``)."""
    groups = tuple(
        tuple(sorted((str(k), repr(_plain(v))) for k, v in g.items() if k != "params"))
        for g in param_groups
    )
    has_grad = (
        bytes(p.grad is not None for g in param_groups for p in g["params"]) if grads else b""
    )
    return StepDescription(optimizer, groups, has_grad, ())


def labels(
    param_groups: Sequence[Mapping[str, Any]], names: Mapping[int, str] | None = None
) -> tuple[str, ...]:
    """How a message names each parameter of ``param_groups`` (``names``: by ``id``)."""
    names = names or {}
    return tuple(
        (f"'{names[id(p)]}'" if id(p) in names else f"#{pi}")
        + f" (param group {gi}, shape {list(p.shape)})"
        for gi, g in enumerate(param_groups)
        for pi, p in enumerate(g["params"])
    )


def check_step(
    where: str,
    optimizer: str,
    param_groups: Sequence[Mapping[str, Any]],
    refused: GradsyncError | None,
    peers: Peers | None,
    *,
    grads: bool = True,
    hidden: bool = True,
) -> None:
    """Raise on every rank unless every rank is about to step ``optimizer`` with the same
    ``param_groups`` settings (and, with ``grads``, the same parameters holding a ``.grad``)
    and no rank's own check ``refused`` the step. ``peers`` ``None``: one rank, nothing to
    compare. A collective over the peers: every rank calls it. ``hidden``: the optimizer is
    sharded, so a difference would not show in the replicas (the message says so)."""
    if peers is None:
        if refused is not None:
            raise refused
        return
    mine = describe(optimizer, param_groups, grads=grads)
    fp = mine.fingerprint()
    top, neg_bottom, any_refused = peers.reduce_max([fp, -fp, int(refused is not None)])
    if top == -neg_bottom and not any_refused:
        return
    problem = None if refused is None else (type(refused).__name__, str(refused))
    mine = replace(mine, labels=labels(param_groups, peers.names), refused=problem)
    everyone: list[StepDescription] = peers.gather(mine)
    if refused is not None:
        raise refused  # this rank's own error, with its traceback; the others name this rank
    for rank, d in enumerate(everyone):
        if d.refused is not None:
            kind, message = d.refused
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, GradsyncError)):
                cls = UsageError
            raise cls(f"rank {rank} refused {where}: {message.removeprefix('gradsync: ')}")
    raise UsageError(f"{where}: {disagreement(everyone, hidden)}")


def disagreement(everyone: list[StepDescription], hidden: bool = True) -> str:
    """Which settings and gradients differ from rank 0's, naming values and ranks."""
    ref, lines = everyone[0], []
    for rank, d in enumerate(everyone[1:], start=1):
        if d.optimizer != ref.optimizer:
            lines.append(f"the optimizer is {ref.optimizer} on rank 0, {d.optimizer} on {rank}")
        if len(d.groups) != len(ref.groups):
            lines.append(
                f"rank 0 has {len(ref.groups)} param groups, rank {rank} has {len(d.groups)}"
            )
        for gi, (a, b) in enumerate(zip(ref.groups, d.groups, strict=False)):
            ours, theirs = dict(a), dict(b)
            for key in sorted(ours.keys() | theirs.keys()):
                x, y = ours.get(key, "(not set)"), theirs.get(key, "(not set)")
                if x != y:
                    lines.append(
                        f"param group {gi}'s {key!r} is {x} on rank 0 and {y} on rank {rank}"
                    )
        for label, ours_has, theirs_has in zip(ref.labels, ref.has_grad, d.has_grad, strict=False):
            if ours_has != theirs_has:
                have, lack = (0, rank) if ours_has else (rank, 0)
                lines.append(
                    f"parameter {label} has a .grad on rank {have} and none on rank {lack}"
                )
    grads = any("has a .grad" in line for line in lines)
    settings = len(lines) > sum("has a .grad" in line for line in lines)
    fixes = []
    if settings:
        fixes.append(
            "set hyper-parameters alike on every rank (an LR scheduler, or a loop that sets "
            "group['lr'], must run on every rank)"
        )
    if grads:
        fixes.append("clear gradients (zero_grad(), .grad = None) on every rank alike")
    shown = lines[:MAX_LINES] + (
        [f"... and {len(lines) - MAX_LINES} more"] * (len(lines) > MAX_LINES)
    )
    why = (
        "each rank steps its own slice of the parameters, so the all-gather would hide the "
        "difference while the model trains wrongly"
        if hidden
        else "the replicas would drift apart"
    )
    fix = "; ".join(fixes)
    return (
        f"the ranks would step differently ({why}):\n  "
        + "\n  ".join(shown)
        + f"\n{fix[:1].upper()}{fix[1:]}. Nothing was stepped."
    )
