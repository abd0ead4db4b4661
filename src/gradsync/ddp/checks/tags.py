"""Where each rank is in its training loop, carried in the first bucket of every step.

[Note: step tags]
Backends match collectives by issue order only. If one rank skips a backward, runs one forward
under ``no_sync()`` that the others run synchronised, or runs an extra training forward, its
step k+1 is summed with the others' step k: gradients of different steps mix and nothing
complains until, maybe, a hang many steps later. So every rank writes a *step tag* into its own
slots of the first bucket: how many synchronised steps it has completed, how many training
forwards (and how many of them under ``no_sync``) it ran in this accumulation window, how many
in-place updates its parameters have seen since wrapping, flags for "my parameter set changed
since wrapping" and "I never declared items" (``item_mean``), and the loop's own number of the
step, where a driver of the loop numbers its steps (``gradsync.recovery``'s ``Step.number``).
That last field is what the wrapper alone cannot know: a rank that skips a whole step (no
forward, no backward) runs its next step's reduction as its k-th, as the others run their
k-th, so counts of synchronised backwards agree while the gradients are of different steps.
Every other rank writes
zeros there, so after the sum each rank reads every rank's tag exactly, at no extra collective,
and all ranks reach the same verdict at the step where things went wrong. The slots are the
tags' rider in bucket 0's tail ([Note: bucket 0's tail] in ``ddp/tail.py``). The step's other
collective, the item exchange, is issued with the buckets on every rank and its total is used
only after this verdict, so a pairing of two steps' item counts is caught here too.

Values are kept below 128 (modulo) and stored plus one, so zero means "no tag" (a rank that has
joined and answers with zeros; a loop step of zero: no driver numbers the steps) and every
value is exact in any bucket dtype, bfloat16 included.
A communication hook must carry these slots losslessly (see [Note: the bucket communication
seam]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.window import StepWindow

MODULUS = 128
NUM_FIELDS = 6
RIDER = "step tags"  # its name in bucket 0's tail (ddp/tail.py)
PARAMS_CHANGED = 1
NO_ITEMS = 2


@dataclass(frozen=True)
class StepTag:
    steps: int  # synchronised backwards this rank has completed
    forwards: int  # training forwards in this accumulation window, the synchronised one too
    no_sync: int  # of which under no_sync()
    updates: int  # in-place updates of the parameters since wrapping
    flags: int  # PARAMS_CHANGED | NO_ITEMS
    loop_step: int | None = None  # the loop's number of the step, where a driver gives one

    def encode(self) -> list[float]:
        # The fields by hand: dataclasses.astuple deep-copies each one (a few us a step).
        fields = (self.steps, self.forwards, self.no_sync, self.updates, self.flags)
        loop = 0.0 if self.loop_step is None else float(self.loop_step % MODULUS + 1)
        return [*(float(v % MODULUS + 1) for v in fields), loop]


class Tagged(Protocol):
    """What a tag is made of: the reducer's facts of the step it is about to reduce."""

    num_reductions: int
    loop_step: int | None
    window: StepWindow
    watch: ParameterWatch
    reduction: Reduction


class TagRider:
    """The step tags' rider in bucket 0's tail (``ddp/tail.py``)."""

    name = RIDER
    width = NUM_FIELDS

    def encode(self, step: Tagged) -> list[float]:
        window = step.window
        flags = PARAMS_CHANGED * bool(window.changes) | NO_ITEMS * step.reduction.missing_count
        updates = step.watch.updates_since_wrapping()
        tag = StepTag(
            step.num_reductions, window.forwards, window.no_sync, updates, flags, step.loop_step
        )
        return tag.encode()

    def decode(self, values: list[float], world_size: int) -> list[StepTag | None]:
        return decode(values, world_size)


def decode(values: list[float], world_size: int) -> list[StepTag | None]:
    """Every rank's tag from the summed slots (``None``: the rank sent none, it has joined)."""
    tags: list[StepTag | None] = []
    for r in range(world_size):
        raw = [int(v) for v in values[r * NUM_FIELDS : (r + 1) * NUM_FIELDS]]
        if not any(raw):
            tags.append(None)
            continue
        steps, forwards, no_sync, updates, flags, loop = (v - 1 for v in raw)
        loop_step = loop if loop >= 0 else None
        tags.append(StepTag(steps, forwards, no_sync, updates, flags, loop_step))
    return tags


def _unwrap(value: int, near: int) -> int:
    """The integer congruent to ``value`` modulo MODULUS that is closest to ``near``."""
    delta = (value - near) % MODULUS
    return near + (delta - MODULUS if delta >= MODULUS // 2 else delta)


def _position(tag: StepTag, my_steps: int, my_loop_step: int | None) -> str:
    step = _unwrap(tag.steps, my_steps)
    plural = "s" if tag.forwards != 1 else ""
    loop = ""
    if tag.loop_step is not None:
        near = tag.loop_step if my_loop_step is None else my_loop_step
        loop = f"the loop's step {_unwrap(tag.loop_step, near)}, synchronised "
    return (
        f"{loop}step {step}, {tag.forwards} training forward{plural} since the last "
        f"synchronised backward ({tag.no_sync} under no_sync())"
    )


SKIPPED_STEP = (
    "A rank ran another step of the loop than the others: look for a rank that skipped a whole "
    "step (with gradsync.recovery, every rank runs every step's body: step.micro_batches() "
    "gives a rank whose share is empty a micro-batch of no sample)."
)


def find_desync(
    tags: list[StepTag | None],
    my_steps: int,
    compare_windows: bool = True,
    my_loop_step: int | None = None,
) -> str | None:
    """A message naming the ranks whose position differs from the majority's, or ``None``.

    ``compare_windows=False`` compares synchronised steps only: with ``item_mean`` ranks may
    legitimately run different numbers of micro-batches per step (the item counts weight
    them); with ``mean`` and ``sum`` every rank's window must hold the same number. The loop's
    numbers of the step (``my_loop_step``: this rank's) are compared whenever ranks give them.
    """
    positions: dict[StepTag, list[int]] = {}
    for r, tag in enumerate(tags):
        if tag is not None:
            forwards, no_sync = (tag.forwards, tag.no_sync) if compare_windows else (0, 0)
            key = StepTag(tag.steps, forwards, no_sync, 0, 0, tag.loop_step)
            positions.setdefault(key, []).append(r)
    if len(positions) <= 1:
        return None
    groups = sorted(positions.items(), key=lambda kv: len(kv[1]), reverse=True)
    lines = [f"  rank(s) {r}: {_position(tag, my_steps, my_loop_step)}" for tag, r in groups]
    skipped = len({tag.loop_step for tag in positions}) > 1
    return (
        "ranks are at different points of their training loops, so this step would sum "
        "gradients of different micro-batches:\n"
        + "\n".join(lines)
        + "\n"
        + (SKIPPED_STEP + " " if skipped else "")
        + "Every rank must run "
        "the same sequence of training forwards and backwards: look for a rank that skipped a "
        "backward (e.g. on a NaN loss; agree first with gradsync.any_rank), ran an extra "
        "forward in training mode with grad enabled (use torch.no_grad() or eval()), or used "
        "no_sync() for a different number of micro-batches."
    )


def ranks_with_flag(tags: list[StepTag | None], flag: int) -> list[int]:
    return [r for r, tag in enumerate(tags) if tag is not None and tag.flags & flag]


def updates_differ(tags: list[StepTag | None]) -> bool:
    return len({tag.updates for tag in tags if tag is not None}) > 1


def steps_differ(numbers: Sequence[int | None], what: str) -> str | None:
    """A message naming the ranks by the loop's step each gave with ``what`` (an exchange of
    every rank's number: ``None``, a rank that gave none), or ``None`` if they agree."""
    by_step: dict[int, list[int]] = {}
    for r, number in enumerate(numbers):
        if number is not None:
            by_step.setdefault(number, []).append(r)
    if len(by_step) <= 1:
        return None
    groups = sorted(by_step.items(), key=lambda kv: len(kv[1]), reverse=True)
    lines = "\n".join(f"  rank(s) {ranks}: the loop's step {n}" for n, ranks in groups)
    return (
        f"ranks are at different points of their training loops, so {what} would mix "
        f"different steps:\n{lines}\n{SKIPPED_STEP}"
    )
