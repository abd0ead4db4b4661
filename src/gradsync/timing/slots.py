"""Every rank's phases of the last interval, carried in the first bucket beside the step tags.

A rider of bucket 0's tail ([Note: bucket 0's tail] in ``ddp/tail.py``), like the step tags:
each rank writes its own slots and zeros in everyone else's, so the bucket's sum hands every
rank every rank's record with no collective of its own, and the step's readout reads them in
the same device-to-host copy. A record is the interval *before* the step that carries it (the
one being reduced is not over yet), so reports run one step behind.

Per rank: a presence flag (a joined rank sends none), the phases in milliseconds, then the
launch offset of up to ``MAX_LAUNCHES`` buckets. Values travel in the bucket's dtype: a bf16
bucket rounds a duration to 3 significant digits, enough to name a straggler; they are clamped
to what fp16 can hold (a minute).
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.timing.phases import PHASES, RankStep

MAX_LAUNCHES = 32  # buckets whose launch is carried (the first ones: those of the last layers)
LIMIT_MS = 60_000.0
RIDER = "timings"  # its name in bucket 0's tail (ddp/tail.py)


def fields_per_rank(num_buckets: int) -> int:
    return 1 + len(PHASES) + min(num_buckets, MAX_LAUNCHES)


def encode(record: RankStep, num_buckets: int) -> list[float]:
    """This rank's slots for ``record``: the presence flag, the phases, then the launches of the
    first ``MAX_LAUNCHES`` buckets (zeros where not known), each clamped to ``[0, LIMIT_MS]``."""
    num_launches = fields_per_rank(num_buckets) - 1 - len(PHASES)
    launches = list(record.launches[:num_launches])
    launches += [0.0] * (num_launches - len(launches))
    return [1.0, *(min(max(v, 0.0), LIMIT_MS) for v in (*record.phases, *launches))]


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
