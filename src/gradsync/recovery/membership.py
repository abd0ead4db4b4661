"""Who goes on after a rank is lost: one membership, decided once, through the store.

[Note: one membership per generation]
Survivors notice a lost rank at different moments (one inside a bucket's all-reduce, another
already in the next forward), and a survivor that is slow to notice looks, from another host,
exactly like a dead one. Two survivors that decided separately could each go on with a group
of their own (split brain). So they do not decide separately: one of them decides for all.

1. Every survivor of generation ``g`` appends its report (the steps it has completed, where it
   was) to one key under ``g``'s prefix of the job's store, and proposes itself as the roll
   call's leader with ``compare_set`` on another: the first proposal stands, and every later
   caller reads it back.
2. The leader waits until every member has answered or is seen gone: its process has exited
   (on this host, ``failfast/liveness.py``), or its heartbeat has stood still for
   ``heartbeat.STALE_S`` ([Note: heartbeats]). A member whose heartbeat goes on is alive, and
   is waited for, at most ``window`` seconds; one still silent then (stuck in a collective of
   its own), or one seen stopped on this host, is not recovered from in-process: the decision
   says so, and every survivor takes the restart path.
3. The leader writes the decision, with every member's report, to one key; the others wait for
   that key (``window`` plus the leader's own bound and ``GRACE_S``) and read it. A leader that
   does not decide within that (it died during the roll call) sends them to the restart path.
4. A rank left out of it (it answered after the decision) may not go on: it raises
   :class:`RankExcludedError` and its process ends.

So a survivor that is not the leader makes five store operations, whatever the world size: the
announcement, its answer, the leader proposal, the wait and the read of the decision; the
leader reads one key of answers and the counters of the members it still waits for, in one
``multi_get``, a few times in a poll. Bytes grow with the world size (a line per member), round
trips do not. ``docs/recovery.md`` has the model at 1,024 and 4,096 ranks.

The store is the one thing every member must still reach: with torchrun it lives on the first
node's agent (or on global rank 0's process with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); when
it is gone, so is in-process recovery, and the job takes the restart path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from gradsync.errors import GradsyncError
from gradsync.failfast.liveness import Fate, ProcessId, process_state, this_process
from gradsync.recovery.heartbeat import STALE_S, Staleness, beat_key

GRACE_S = 2.0  # beyond the leader's own bound, before the others give up waiting for it
_POLL_S = 0.02  # the leader's longest pause between two looks at the answers


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
    """Say which process holds ``rank`` in the generation ``scope`` names (for liveness): one
    line appended to one key, which only a roll call's leader reads."""
    store.append(_key(scope, "processes"), f"{rank} {this_process().encode()}\n")  # type: ignore[attr-defined]


def processes(store: dist.Store, scope: str) -> dict[int, ProcessId | None]:
    """Every member's process in the generation ``scope`` names, as published so far."""
    key = _key(scope, "processes")
    if not store.check([key]):
        return {}
    lines = (line.split(" ", 1) for line in store.get(key).decode().splitlines())
    return {int(rank): ProcessId.decode(text) for rank, text in lines}


def gather(store: dist.Store, scope: str, what: str, world_size: int, timeout: timedelta) -> None:
    """Return once all ``world_size`` members have called this for ``what``: a barrier through
    the store in three operations each (a count, the last one's mark, a wait for the mark)."""
    if store.add(_key(scope, what, "count"), 1) == world_size:
        store.set(_key(scope, what, "all"), "1")
    store.wait([_key(scope, what, "all")], timeout)


def begun_key(scope: str) -> str:
    return _key(scope, "begun")


def announce(store: dist.Store, scope: str) -> None:
    """Say that a regroup of the generation ``scope`` names has begun: survivors still waiting
    in a collective give up their wait (``failfast.waiting.watch_for_regroups``)."""
    store.set(begun_key(scope), "1")


def begun(store: dist.Store, scope: str) -> bool:
    return store.check([begun_key(scope)])


def agree(
    store: dist.Store, scope: str, current: Membership, report: Report, window: float
) -> tuple[Membership, dict[int, Fate]]:
    """The membership that follows ``current`` ([Note: one membership per generation]), and the
    fate of every member of ``current`` left out of it. ``scope``: the job's name for
    ``current`` in the store. Raises :class:`RankExcludedError` if this rank was left out,
    :class:`NoRecoveryError` if a silent member is alive or the leader decided nothing; store
    errors propagate."""
    rank, generation = current.rank, current.generation
    answer = json.dumps({"rank": rank, **asdict(report)}) + "\n"
    store.append(_key(scope, "answers"), answer)  # type: ignore[attr-defined]
    leader = int(store.compare_set(_key(scope, "leader"), "", str(rank)))
    if leader == rank:
        decided = _lead(store, scope, current.world_size, window)
    else:
        bound = max(window, STALE_S) + GRACE_S
        try:
            store.wait([_key(scope, "members")], timedelta(seconds=bound))
        except dist.DistNetworkError:
            raise
        except RuntimeError:  # the wait's timeout (a FileStore's is untyped)
            raise NoRecoveryError(
                f"the roll call's leader, rank {leader} of generation {generation}, decided "
                f"nothing within {bound:g} s (lost during the roll call?)"
            ) from None
        decided = json.loads(store.get(_key(scope, "members")))
    if decided["stuck"]:  # the leader's verdict, so that every survivor takes the same path
        raise NoRecoveryError(
            f"rank(s) {sorted(map(int, decided['stuck']))} of generation {generation} are alive "
            f"but did not answer ({'; '.join(decided['stuck'].values())}): only ranks that are "
            "gone are left behind in-process"
        )
    members = tuple(decided["members"])
    if rank not in members:
        raise RankExcludedError(
            f"rank {rank} of generation {generation} answered after the others had agreed to "
            f"go on as ranks {list(members)}: this process leaves the job"
        )
    reports = {int(r): Report(**v) for r, v in decided["reports"].items()}
    lost = {int(r): Fate(f) for r, f in decided["lost"].items()}
    return Membership(generation + 1, members, members.index(rank), reports), lost


def _answers(store: dist.Store, scope: str) -> dict[int, Report]:
    records = (json.loads(line) for line in store.get(_key(scope, "answers")).splitlines())
    return {r.pop("rank"): Report(**r) for r in records}


def _lead(store: dist.Store, scope: str, world_size: int, window: float) -> dict:
    """The leader's roll call: wait until every member has answered or is seen gone (at most
    ``window`` for one seen alive); the decision, as every survivor reads it."""
    peers = processes(store, scope)
    # Long enough to see a heartbeat stand still, whatever ``window``.
    give_up = time.monotonic() + max(window, STALE_S + 2 * _POLL_S)
    staleness, pause = Staleness(), 0.001
    gone: dict[int, Fate] = {}
    while True:
        answers = _answers(store, scope)
        waiting = [r for r in range(world_size) if r not in answers]
        alive = _alive(store, scope, waiting, peers, staleness, gone)
        if not alive or time.monotonic() >= give_up:
            break
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S)
    stuck = {
        r: f"rank {r}: {_why_stuck(gone.get(r), peers.get(r))}"
        for r in waiting
        if r not in gone or gone[r] is Fate.STOPPED
    }
    lost = {r: gone[r].value for r in waiting if r in gone and r not in stuck}
    decision = {
        "members": sorted(answers),
        "stuck": stuck,
        "lost": lost,
        "reports": {r: asdict(v) for r, v in answers.items()},
    }
    return dict(json.loads(store.compare_set(_key(scope, "members"), "", json.dumps(decision))))


def _alive(
    store: dist.Store,
    scope: str,
    waiting: list[int],
    peers: Mapping[int, ProcessId | None],
    staleness: Staleness,
    gone: dict[int, Fate],
) -> list[int]:
    """Of the members ``waiting`` to answer, those seen alive; records in ``gone`` those seen
    gone (their process exited here, or their heartbeat stands still) or stopped here."""
    alive, unseen = [], []
    for r in waiting:
        process = peers.get(r)
        state = None if process is None else process_state(process)
        if state in ("gone", "stopped"):
            gone[r] = Fate.GONE if state == "gone" else Fate.STOPPED
        elif state == "running":  # seen running on this host: alive, whatever its heartbeat
            alive.append(r)
        elif r not in gone:
            unseen.append(r)
    for r in unseen:  # few: those that have not answered (adding 0 reads, never blocks)
        if staleness.update(r, store.add(beat_key(scope, r), 0)) >= STALE_S:
            gone[r] = Fate.SILENT
    return alive + [r for r in unseen if r not in gone]


def _why_stuck(fate: Fate | None, process: ProcessId | None) -> str:
    if fate is Fate.STOPPED:
        return f"its {process} is stopped"
    if process is not None and process_state(process) is not None:
        return f"its {process} runs"
    return "its heartbeat goes on"
