"""Who goes on after a rank is lost: one membership, decided once, through the store.

[Note: one membership per generation]
Survivors notice a lost rank at different moments (one inside a bucket's all-reduce, another
already in the next forward), and a survivor that is slow to notice looks, from another host,
exactly like a dead one. Two survivors that decided separately could each go on with a group
of their own (split brain). So they do not decide separately:

1. Every survivor of generation ``g`` writes its report (the steps it has completed) and then
   its answer under ``g``'s prefix of the job's store.
2. It waits for the others' answers, at most ``window`` seconds, less once every other member
   has answered or is seen dead (a process gone on this host: ``failfast/liveness.py``).
3. It proposes the ranks that answered, itself included, with ``compare_set`` on one key. The
   store applies the first proposal and returns it to every later caller: every survivor reads
   the same membership, whatever it proposed.
4. A rank left out of it (it answered after the decision) may not go on: it raises
   :class:`RankExcludedError` and its process ends. A rank seen alive but silent (stopped, or
   stuck in the old group) is not recovered from in-process: it may still write what it holds.

The store is the one thing every member must still reach: with torchrun it lives on the first
node's agent (or on global rank 0's process with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); when
it is gone, so is in-process recovery, and the job takes the restart path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch.distributed as dist

from gradsync.errors import GradsyncError
from gradsync.failfast.liveness import Fate, ProcessId, roll_call, this_process


class RankExcludedError(GradsyncError, RuntimeError):
    """This rank answered after the survivors had agreed to go on without it."""


class NoRecoveryError(GradsyncError, RuntimeError):
    """The lost rank cannot be recovered from in-process (the message says why): the job takes
    the restart path (torchrun restarts it; the newest checkpoint is loaded)."""


@dataclass(frozen=True)
class Report:
    """What a survivor says of itself at an agreement (in the store, as JSON)."""

    done: int
    """The steps it had completed, over all epochs: the survivors redo the earliest step one
    of them had not."""
    phase: str
    """Where it was in its step when it noticed the loss: ``forward``, ``backward`` or
    ``optimizer step``."""
    stepped: int | None = None
    """The step in which its optimizer last stepped (``rollback.py``: the holder of a step's
    result)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Membership:
    """One generation of the job: its members (by their ranks in the generation before) and
    this process's place in it."""

    generation: int
    """How many membership changes the job has been through."""
    members: tuple[int, ...]
    """The members that stayed, by their ranks in the generation before, in their new rank
    order."""
    rank: int
    """This process's rank in this generation."""
    reports: Mapping[int, Report]
    """What each member reported at the agreement that formed it (by its rank before)."""
    joined: tuple[int, ...] = ()
    """Replacements admitted (their tickets), ranked after the members."""

    @property
    def world_size(self) -> int:
        return len(self.members) + len(self.joined)


def _key(scope: str, *parts: object) -> str:
    return "/".join(["gradsync/recovery", scope, *map(str, parts)])


def publish_process(store: dist.Store, scope: str, rank: int) -> None:
    """Say which process holds ``rank`` in the generation ``scope`` names (for liveness)."""
    store.set(_key(scope, "process", rank), this_process().encode())


def processes(store: dist.Store, scope: str, world_size: int) -> dict[int, ProcessId | None]:
    """Every member's process in the generation ``scope`` names (as published); waits."""
    keys = [_key(scope, "process", r) for r in range(world_size)]
    store.wait(keys)
    return {r: ProcessId.decode(store.get(k).decode()) for r, k in enumerate(keys)}


def announce(store: dist.Store, scope: str) -> None:
    """Say that a regroup of the generation ``scope`` names has begun: survivors still waiting
    in a collective give up their wait (``failfast.deadline.watch_for_regroups``)."""
    store.set(_key(scope, "begun"), "1")


def begun(store: dist.Store, scope: str) -> bool:
    return store.check([_key(scope, "begun")])


def agree(
    store: dist.Store,
    scope: str,
    current: Membership,
    report: Report,
    peers: Mapping[int, ProcessId | None],
    window: float,
) -> tuple[Membership, dict[int, Fate]]:
    """The membership that follows ``current`` ([Note: one membership per generation]), and the
    fate of every member of ``current`` left out of it. ``scope``: the job's name for
    ``current`` in the store; ``peers``: the members of ``current`` with their processes.
    Raises :class:`RankExcludedError` if this rank was left out, :class:`NoRecoveryError` if a
    silent member is alive; store errors propagate."""
    rank, generation = current.rank, current.generation
    store.set(_key(scope, "report", rank), report.to_json())
    others = {r: (_key(scope, "answer", r), p) for r, p in peers.items() if r != rank}
    fates = roll_call(store, _key(scope, "answer", rank), others, window)
    answered = sorted([rank, *(r for r, f in fates.items() if f is Fate.ANSWERED)])
    stuck = sorted(r for r, f in fates.items() if f in (Fate.STOPPED, Fate.RUNNING))
    proposal = json.dumps({"members": answered, "stuck": stuck})
    decided = json.loads(store.compare_set(_key(scope, "members"), "", proposal))
    members = tuple(decided["members"])
    if decided["stuck"]:  # the decider's verdict, so that every survivor takes the same path
        raise NoRecoveryError(
            f"rank(s) {decided['stuck']} of generation {generation} are alive but did not "
            "answer (stopped, or stuck in a collective): only ranks that are gone are left "
            "behind in-process"
        )
    if rank not in members:
        raise RankExcludedError(
            f"rank {rank} of generation {generation} answered after the others had agreed to "
            f"go on as ranks {list(members)}: this process leaves the job"
        )
    reports = {r: Report.from_json(store.get(_key(scope, "report", r))) for r in members}
    lost = {r: f for r, f in fates.items() if r not in members}
    new = Membership(generation + 1, members, members.index(rank), reports)
    return new, lost
