"""Parameters that get no gradient go to the last buckets, once, after the first step.

[Note: unused parameters and overlap]
Buckets launch in index order (see [Note: when a bucket fires] in ``launch.py``). With
``find_unused_parameters=True`` (or ``static_graph``) a parameter that gets no gradient in a step
leaves its bucket pending until the end of backward, where it is filled late, and every later
bucket waits behind it. An unused parameter among the last layers (a head the loss skips, a
branch switched off) sits in the first bucket, so no bucket launches before backward ends:
no overlap at all.

torch DDP walks the autograd graph from each forward's outputs to find the parameters it will
not reach and marks them ready at once. gradsync re-plans once instead, after the first
synchronised step, as torch rebuilds its buckets once: the parameters that step left unused on
some rank go to the last buckets (every rank reads the same set from the summed used flags),
which launch at the end of backward anyway, and every other bucket launches as soon as its
gradients are ready. Why not the walk: it costs a traversal of the graph per step (in Python
here), and it breaks where the walk cannot see a parameter (reentrant activation checkpointing
hides the recomputed segment's parameters, whose gradients then arrive after they were marked
unused; torch raises there). The re-plan costs nothing per step and changes no result (the
same gradients, in other buckets). It helps where the unused set stays the same from step to
step; parameters that are unused in some steps only (mixture-of-experts routing) keep delaying
their buckets in those steps: correct, less overlapped.

The choice is part of gradsync's sync state (``sync_state_dict``), so a resumed run plans the
buckets its uninterrupted twin had: bucket boundaries change the order in which some
collectives sum at 3 ranks or more, and resume is bit-identical. The buckets stay as planned
with PowerSGD or a registered torch comm hook (their state is per bucket) and with
``bucket_cap_mb="auto"`` (which plans from its own profile of the job).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradsync.comm import PowerSGD
from gradsync.ddp.options import SyncOptions


class UnusedLast:
    """Decides once which parameters the buckets plan last (see the note above)."""

    def __init__(self, options: SyncOptions) -> None:
        # Parameters may go unused, and the buckets may be re-planned: PowerSGD's state is per
        # bucket, and "auto" plans by itself (register_comm_hook turns it off: per bucket too).
        fixed = options.auto or isinstance(options.compression, PowerSGD)
        self.enabled = options.tolerates_unused and not fixed
        self.last: tuple[int, ...] | None = None  # decided: planned last (None: not yet)

    def disable(self) -> None:
        """Keep the buckets as planned from now on (a torch comm hook's state is per bucket)."""
        self.enabled = False

    def before_forward(
        self, first_unused: tuple[int, ...] | None, replan: Callable[[tuple[int, ...]], object]
    ) -> None:
        """At a training forward between steps: once the first step has told which parameters
        it left unused (``first_unused``, from the reducer), plan them last (``replan``)."""
        if not self.enabled or self.last is not None or first_unused is None:
            return
        self.last = first_unused
        if self.last:
            replan(self.last)

    def state(self) -> list[int] | None:
        """What a checkpoint keeps: the decision, if made."""
        return None if self.last is None else list(self.last)

    def load(self, last: Sequence[int] | None, replan: Callable[[tuple[int, ...]], object]) -> None:
        """Take a checkpoint's decision (``None``: not made yet there) and plan by it."""
        if not self.enabled:
            return
        loaded = None if last is None else tuple(int(i) for i in last)
        if (loaded or ()) != (self.last or ()):
            replan(loaded or ())  # (): the plan of registration order
        self.last = loaded
