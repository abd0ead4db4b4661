"""Every error gradsync raises on purpose, in one hierarchy.

``except gradsync.GradsyncError`` catches them all. Each class also derives from the builtin it
stands for (``RuntimeError`` for faults met while running, ``ValueError`` for a mistake in what
the user passed), so ``except RuntimeError`` clauses written before this hierarchy still work.
Messages are written without a prefix: the base class adds ``gradsync:`` once, here.
"""

from __future__ import annotations

from typing import Any


class GradsyncError(Exception):
    """Base of gradsync's errors; the message starts with ``gradsync:``."""

    def __init__(self, message: str = "") -> None:
        text = str(message)
        super().__init__(text if text.startswith("gradsync:") else f"gradsync: {text}")


# -- the user's model, arguments or call order --------------------------------------------------
class UsageError(GradsyncError, ValueError):
    """An argument or setting gradsync cannot accept; the message names it."""


class ModelMismatchError(UsageError):
    """Ranks hold different models or wrapper settings at construction."""


class ProtocolError(GradsyncError, RuntimeError):
    """The training loop called gradsync in an order that would leave gradients unsynchronised
    (a backward without a forward through the wrapper, a forward during backward, ...)."""


# -- faults detected while training -------------------------------------------------------------
class CollectiveTimeoutError(GradsyncError, RuntimeError):
    """A gradsync collective did not complete within the deadline, or a peer dropped out."""


class UnusedParametersError(GradsyncError, RuntimeError):
    """Some parameter got no gradient on some rank while ``find_unused_parameters=False``."""


class NonFiniteGradientError(GradsyncError, RuntimeError):
    """A gradient held NaN or Inf before communication (``check_finite=True``)."""


class ReplicaMismatchError(GradsyncError, RuntimeError):
    """Replicas that should be bit-identical are not."""


class DesyncError(GradsyncError, RuntimeError):
    """Ranks reached a reduction from different points of their training loops (a skipped
    backward, an extra forward, ``no_sync`` used differently), so their gradients would mix."""


class ParametersChangedError(GradsyncError, RuntimeError):
    """The module's parameter set changed after wrapping (``requires_grad`` flipped, a
    parameter or submodule replaced or added): buckets and hooks no longer match it."""


class CheckpointError(GradsyncError, RuntimeError):
    """A checkpoint cannot be loaded as it is: truncated, corrupted (a checksum differs), a file
    missing, or saved from a different model or world size; the message names the file."""


# -- the harnesses: local ranks and the simulated cluster ---------------------------------------
class SpawnError(GradsyncError, RuntimeError):
    """One or more ranks started by :func:`gradsync.testing.spawn.spawn` failed."""

    failures: list[Any]  # each failed rank's RankFailure, set by the harness


class ClusterError(GradsyncError, RuntimeError):
    """Setting up the simulated cluster failed (the message carries the failing command)."""


class LaunchError(GradsyncError, RuntimeError):
    """One or more nodes of a simulated-cluster launch failed or timed out."""

    results: list[Any]  # each node's NodeResult, set by the harness


def first_line(error: BaseException, default: str | None = None) -> str:
    """The first line of ``error``'s message, for a one-line report of it; ``default`` where the
    message is empty (the error's type name unless given)."""
    text = str(error)
    if text:
        return text.splitlines()[0]
    return type(error).__name__ if default is None else default


__all__ = [
    "CheckpointError",
    "ClusterError",
    "CollectiveTimeoutError",
    "DesyncError",
    "GradsyncError",
    "LaunchError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "ParametersChangedError",
    "ProtocolError",
    "ReplicaMismatchError",
    "SpawnError",
    "UnusedParametersError",
    "UsageError",
]
