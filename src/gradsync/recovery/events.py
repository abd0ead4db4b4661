"""Membership changes as typed records, and the lines rank 0 logs for them.

A job's membership changes in three ways, each recorded on every member as one frozen record
in :attr:`Recovery.changes <gradsync.recovery.Recovery.changes>`: survivors went on without a
lost rank (:class:`Lost`), this process joined a running job as a replacement
(:class:`Joined`), or the members admitted replacements (:class:`Admitted`). Times are
``time.time()`` of the process that recorded them, so that the phases of one change can be
lined up across hosts. :meth:`as_dict` gives each as the JSON-ready dict that
:attr:`Recovery.events <gradsync.recovery.Recovery.events>` lists (``result.json`` of
``examples/train_recoverable.py`` holds them).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from gradsync.recovery.membership import RankExcludedError


@dataclass(frozen=True)
class Lost:
    """The survivors of a loss went on as a new generation and redid the interrupted step."""

    generation: int
    """The generation the survivors formed."""
    lost: tuple[int, ...]
    """The ranks left behind (their ranks in the generation before), in order."""
    step: int
    """The step redone: the earliest step some survivor had not completed."""
    phases: tuple[str, ...]
    """Where the survivors were when they noticed the loss (``forward``, ``backward``,
    ``optimizer step``), each once, in order."""
    world_size: int
    """The new world size."""
    rank: int
    """This process's rank in the new generation."""
    noticed: float
    """When this process noticed the loss (the step raised)."""
    agreed: float
    """When the survivors' membership was decided, as this process read it."""
    regrouped: float
    """When this process's new groups were up and the wrapper moved to them."""
    error: str
    """What the step raised on this process: its type and first line."""
    redone_s: float | None = None
    """How long the redone step took once regrouped (``None`` until it completes)."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict; ``redone_s`` only once the step is redone."""
        out = _json_ready(self)
        if self.redone_s is None:
            del out["redone_s"]
        return out


@dataclass(frozen=True)
class Joined:
    """This process joined a running job as a replacement, with a live peer's state."""

    generation: int
    """The generation it joined."""
    joined: tuple[int, ...]
    """The tickets admitted with it, its own included, in rank order."""
    step: int
    """The step the job goes on from."""
    world_size: int
    """The new world size."""
    rank: int
    """This process's rank in the new generation."""
    asked: float
    """When it took its ticket."""
    admitted: float
    """When it read its admission."""
    switched: float
    """When it held the job's state and was ready to train."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return _json_ready(self)


@dataclass(frozen=True)
class Admitted:
    """The members admitted replacements at a step boundary and trained on with them."""

    generation: int
    """The generation the members and the newcomers formed."""
    joined: tuple[int, ...]
    """The tickets admitted, in rank order (after the members)."""
    step: int
    """The step at which they were admitted."""
    world_size: int
    """The new world size."""
    rank: int
    """This process's rank in the new generation."""
    started: float
    """When this process began the switch."""
    asked: float | None
    """When the first admitted ticket was taken (rank 0 reads it; ``None`` elsewhere)."""
    regrouped: float
    """When this process's new groups were up."""
    switched: float
    """When the state was sent and the wrapper moved to the new groups."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return _json_ready(self)


Change = Lost | Joined | Admitted


def _json_ready(record: Change) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(record).items()}


def log_lost(event: Lost) -> None:
    """Rank 0's line for a loss recovered from, once the redone step completed."""
    if event.rank != 0:
        return
    assert event.redone_s is not None, "logged once the redone step completes"
    lost, where = ", ".join(map(str, event.lost)), "/".join(event.phases)
    total = event.regrouped - event.noticed + event.redone_s
    what = (
        f"rank {lost} lost" if lost else f"no rank lost, though a collective failed ({event.error})"
    )
    _logger().warning(
        f"gradsync: {what} at step {event.step} (noticed in {where}); "
        f"continuing on {event.world_size} ranks, step {event.step} redone "
        f"in {total:.2f} s"
    )


def log_admitted(event: Admitted) -> None:
    """Rank 0's line for replacements admitted."""
    if event.rank != 0:
        return
    _logger().warning(
        f"gradsync: {len(event.joined)} rank(s) joined at step {event.step}; continuing "
        f"on {event.world_size} ranks (switched in {event.switched - event.started:.2f} s)"
    )


def log_fallback(rank: int, step: int, error: BaseException) -> None:
    """The line of a rank that cannot recover in-process: it leaves, or the job restarts."""
    if isinstance(error, RankExcludedError):
        _logger().error(f"{error} (step {step})")
        return
    _logger().error(
        f"gradsync: rank {rank} cannot recover in-process at step {step} ({error}); "
        "exiting so that the job restarts from its last checkpoint"
    )


def _logger() -> logging.Logger:
    return logging.getLogger("gradsync.recovery")
