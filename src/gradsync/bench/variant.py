"""A variant of data-parallel training that the step-time harnesses time (``steptime.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEFAULT_CAP = "default"
"""A variant's cap for gradsync's default (``bucket_cap_mb=None``, which depends on where the
ranks are): a word of its own, since ``None`` in a variant is one bucket."""


ONE_BUCKET_MB = 1e6  # larger than any model here: torch DDP then plans a single bucket


def wrapper_cap(cap: float | str | None) -> float | str | None:
    """The ``bucket_cap_mb`` a gradsync wrapper is built with for a variant's ``cap``."""
    return None if cap == DEFAULT_CAP else cap


def torch_ddp_caps(cap: float | str | None) -> dict[str, Any]:
    """The bucket arguments torch's ``DistributedDataParallel`` is built with for ``cap``.

    Its default is the argument left out, not ``bucket_cap_mb=25``: only then does torch close
    its first bucket at 1 MiB (``_DEFAULT_FIRST_BUCKET_BYTES``); given any cap, the first
    bucket gets that cap too, and the bench's GPT goes from 3 all-reduces a step to 2."""
    if cap == DEFAULT_CAP:
        return {}
    if cap is None or cap == math.inf:
        return {"bucket_cap_mb": ONE_BUCKET_MB}
    assert not isinstance(cap, str), cap
    return {"bucket_cap_mb": cap}


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
    straggler_every: int | None = None  # gradsync's step timeline: None keeps the wrapper's
    # default (10), 0 turns it off
