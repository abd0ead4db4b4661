"""Every rank's phases of the last interval, carried in the first bucket after the step tags.

Like the step tags ([Note: step tags] in ``ddp/checks/tags.py``), each rank writes its own
slots and zeros in everyone else's, so the bucket's sum hands every rank every rank's record
with no collective of its own, and the step's readout reads them in the same device-to-host
copy. A record is the interval *before* the step that carries it (the one being reduced is not
over yet), so reports run one step behind.

Per rank: a presence flag (a joined rank sends none), the phases in milliseconds, then the
launch offset of up to ``MAX_LAUNCHES`` buckets. Values travel in the bucket's dtype: a bf16
bucket rounds a duration to 3 significant digits, enough to name a straggler; they are clamped
to what fp16 can hold (a minute).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.timing.phases import PHASES, RankStep

MAX_LAUNCHES = 32  # buckets whose launch is carried (the first ones: those of the last layers)
LIMIT_MS = 60_000.0


def fields_per_rank(num_buckets: int) -> int:
    return 1 + len(PHASES) + min(num_buckets, MAX_LAUNCHES)


class TimingSlots:
    """Writes this rank's record into its slots (``values``: every rank's, in bucket 0)."""

    def __init__(self, values: torch.Tensor, rank: int, num_buckets: int) -> None:
        self.width = fields_per_rank(num_buckets)
        self.values = values
        self.mine = values[rank * self.width : (rank + 1) * self.width]
        self.staging = torch.empty(self.width, dtype=values.dtype, pin_memory=values.is_cuda)
        self.written = [0.0] * self.width  # as last written, on the host (world size 1)

    def write(self, record: RankStep | None) -> None:
        """``None``: nothing to report (no interval measured yet, or this rank has joined)."""
        self.values.zero_()
        if record is None:
            self.written = [0.0] * self.width
            return
        launches = list(record.launches[: self.width - 1 - len(PHASES)])
        launches += [0.0] * (self.width - 1 - len(PHASES) - len(launches))
        self.written = [1.0, *(min(max(v, 0.0), LIMIT_MS) for v in (*record.phases, *launches))]
        self.staging.copy_(torch.tensor(self.written))
        self.mine.copy_(self.staging, non_blocking=True)  # see TagSlots.write


def decode(values: Sequence[float], world_size: int) -> list[RankStep | None]:
    """Every rank's record from the summed slots (``None``: that rank sent none)."""
    width = len(values) // world_size if world_size else 0
    records: list[RankStep | None] = []
    for r in range(world_size):
        raw = values[r * width : (r + 1) * width]
        # A flag of exactly 1 and values within the limit: anything else was not written by one
        # rank alone (a hook that does not sum exactly), and is not reported.
        if not raw or round(raw[0]) != 1 or max(raw) > LIMIT_MS * 1.01 or min(raw) < 0:
            records.append(None)
            continue
        phases = tuple(float(v) for v in raw[1 : 1 + len(PHASES)])
        records.append(RankStep(phases, tuple(float(v) for v in raw[1 + len(PHASES) :])))
    return records
