"""Healing: a replacement joins the running job at a step boundary, with a live peer's state.

[Note: joining a running job]
A replacement is started by a torchrun of its own (``--standalone``, or any rendezvous the job's
agents do not share: an agent that sees a node ask to join its rendezvous restarts its
workers, which is the restart this avoids), with ``GRADSYNC_JOIN=host:port`` naming the job's
store. Its script is the job's script: it builds the model, optimizer and sampler as every rank
did at the start, and :class:`~gradsync.recovery.Recovery` then, instead of training,

1. takes a ticket (``store.add``) and waits to be admitted;
2. meanwhile the job trains on. At most once a second, at the start of a step ``k``, its rank 0
   looks for tickets not yet admitted and, if there are (and every replacement node they come
   from has asked with all its local ranks, so that a node joins whole, in one change), offers
   them the step ``a`` that is
   the second multiple of ``P`` (``ADMIT_EVERY``, 10) after ``k``, under the generation's name
   in the store. Every member looks for an offer at the start of the steps that are multiples
   of ``P`` (one store read per ``P`` steps). No member can start a step after ``k`` before
   rank 0 began ``k``, so every member reads the offer at the multiple of ``P`` between ``k``
   and ``a``, and all switch at the start of step ``a`` together;
3. at that boundary the members and the admitted regroup as one new generation (the members
   first, in their order, then the newcomers by ticket), and rank 0 broadcasts what the
   newcomers lack: the optimizer's and the LR scheduler's state, the data position and the
   step count, then the wrapper broadcasts its parameters and buffers as at construction, and
   everybody goes on with step ``a`` at the larger world size.

Members lose nothing while a newcomer starts (its imports, model build and connection happen
before it asks), and the switch costs a regroup and one broadcast of the training state.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import GradsyncError

_TICKETS, _ADMITTED = "gradsync/join/tickets", "gradsync/join/admitted"
_CLOSED = "gradsync/join/closed"


class JoinError(GradsyncError, RuntimeError):
    """A replacement could not join the running job (the message says why)."""


@dataclass(frozen=True)
class Offer:
    """Rank 0's offer, under a generation's name in the store: admit ``tickets`` at ``step``."""

    step: int
    """The step at whose start the members and the newcomers switch (step ``a`` of the note)."""
    tickets: tuple[int, ...]
    """The tickets to admit, in their order."""


@dataclass(frozen=True)
class Admission:
    """What rank 0 tells each admitted ticket: the generation it joins and its place in it."""

    namespace: str
    """The job's keys in the store (drawn at the job's start)."""
    generation: int
    """The generation the members and the newcomers form."""
    members: int
    """How many members stay: they keep ranks ``0 .. members - 1``."""
    tickets: tuple[int, ...]
    """The tickets admitted, ranked after the members in this order."""

    @property
    def world_size(self) -> int:
        return self.members + len(self.tickets)

    def rank_of(self, ticket: int) -> int:
        return self.members + self.tickets.index(ticket)


def ask(store: dist.Store) -> int:
    """Take a ticket to join; the job admits tickets in their order, a node's together."""
    ticket = int(store.add(_TICKETS, 1))
    store.set(f"gradsync/join/{ticket}/asked", repr(time.time()))  # for the job's records
    store.set(f"gradsync/join/{ticket}/node", json.dumps(_node()))
    return ticket


def _node() -> dict[str, Any]:
    """The replacement node this process starts with: under torchrun its agent's run (each
    replacement's ``--standalone`` run has an id of its own) and its number of local ranks;
    else a node of its own."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return {"run": f"process {os.getpid()}", "size": 1}
    return {"run": run, "size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}


def asked(store: dist.Store, tickets: tuple[int, ...]) -> float:
    """When the first of ``tickets`` was taken (``time.time()`` of its process)."""
    return min(float(store.get(f"gradsync/join/{t}/asked")) for t in tickets)


def waiting(store: dist.Store) -> tuple[int, ...]:
    """Tickets taken and not yet admitted, once every node they come from has asked with all
    its ranks (a node whose second rank starts a moment after its first joins whole, in one
    membership change, not as two); else none yet."""
    taken, admitted = int(store.add(_TICKETS, 0)), int(store.add(_ADMITTED, 0))
    tickets = tuple(range(admitted + 1, taken + 1))
    keys = [f"gradsync/join/{t}/node" for t in tickets]
    if not tickets or not store.check(keys):
        return ()
    nodes = [json.loads(v) for v in store.multi_get(keys)]
    runs = {node["run"]: node["size"] for node in nodes}
    if any(sum(n["run"] == run for n in nodes) < size for run, size in runs.items()):
        return ()
    return tickets


def offer(store: dist.Store, scope: str, made: Offer) -> None:
    store.set(f"gradsync/recovery/{scope}/offer", json.dumps(asdict(made)))


def offered(store: dist.Store, scope: str) -> Offer | None:
    key = f"gradsync/recovery/{scope}/offer"
    if not store.check([key]):
        return None
    made = json.loads(store.get(key))
    return Offer(made["step"], tuple(made["tickets"]))


def admit(store: dist.Store, admission: Admission) -> None:
    """Tell each admitted ticket the generation it joins: rank 0 does."""
    for ticket in admission.tickets:
        store.set(f"gradsync/join/{ticket}", json.dumps(asdict(admission)))
    store.add(_ADMITTED, len(admission.tickets))


def close(store: dist.Store) -> None:
    """The job has ended: replacements still waiting stop waiting."""
    store.set(_CLOSED, "1")


def wait_for_admission(store: dist.Store, ticket: int, timeout: float) -> Admission:
    key = f"gradsync/join/{ticket}"
    give_up = time.monotonic() + timeout
    while not store.check([key]):
        if store.check([_CLOSED]):
            raise JoinError(f"ticket {ticket}: the job ended before it admitted this replacement")
        if time.monotonic() > give_up:
            raise JoinError(f"ticket {ticket}: not admitted within {timeout:g} s")
        time.sleep(0.05)
    admission = json.loads(store.get(key))
    return Admission(**{**admission, "tickets": tuple(admission["tickets"])})


def transfer_state(
    optimizer: torch.optim.Optimizer, scheduler: Any, small: dict[str, Any], receive: bool
) -> dict[str, Any]:
    """Rank 0's optimizer and LR scheduler state and ``small`` (the data position, the step
    count), pickled onto every rank of the default group; loaded where ``receive`` (members
    hold them already). Returns rank 0's ``small``. The parameters and buffers go with the
    wrapper's own broadcast (``model.regroup(from_rank_0=True)``)."""
    sent: list[Any] = [optimizer.state_dict(), scheduler and scheduler.state_dict(), small]
    dist.broadcast_object_list(sent, group_src=0)
    if receive:
        optimizer.load_state_dict(sent[0])
        if scheduler is not None:
            scheduler.load_state_dict(sent[1])
    return dict(sent[2])
