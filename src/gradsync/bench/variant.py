"""A variant of data-parallel training that the step-time harnesses time (``steptime.py``)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CAP = "default"
"""A variant's cap for gradsync's default (``bucket_cap_mb=None``, which depends on where the
ranks are): a word of its own, since ``None`` in a variant is one bucket."""


def wrapper_cap(cap: float | str | None) -> float | str | None:
    """The ``bucket_cap_mb`` a gradsync wrapper is built with for a variant's ``cap``."""
    return None if cap == DEFAULT_CAP else cap


@dataclass(frozen=True)
class Variant:
    """One way of synchronising gradients."""

    name: str
    kind: str  # "naive" (average_gradients), "gradsync", "torch_ddp", or "local" (no sync);
    # "gradsync_wire" and "torch_ddp_hook": a wire format (see gradsync.bench.wire);
    # "gradsync_auto": bucket_cap_mb="auto" (the plan it switches to after its profiled steps)
    bucket_cap_mb: float | str | None = 25.0  # a string only for gradsync: "scaled", "auto",
    # DEFAULT_CAP
    algorithm: str = "native"
    first_bucket_cap_mb: float | None = 1.0
    wire: str | None = None  # "bf16" or "powersgd" for the wire-format kinds
