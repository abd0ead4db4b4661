"""The step window: one accumulation window, from the first forward after a reduction to the
synchronised backward that reduces it.

[Note: the step window]
A step's gradients may come from several forward/backward pairs (micro-batches under
``no_sync()``), and what gradsync checks and reduces at the end is a fact about all of them:
which parameters got a gradient on this rank, how many training forwards ran and how many of
them accumulated locally, over how many ranks the mean divides (fewer inside ``join()``), and
whether the parameter set changed. :class:`StepWindow` holds those facts and the phase of the
window's last forward; the reducer holds the current window and is its only writer. A window is

- *built* empty after every reduction (and at construction): :meth:`StepWindow.__init__`;
- *continued* whole by a reducer that replaces another between steps (the "auto" switch,
  ``shard_optimizer()``, ``register_comm_hook()``): the new reducer takes the old one's window
  object itself, so nothing is copied field by field;
- *closed* by the reduction: the reducer builds the next one.

The phases, per forward:

    UNPREPARED --forward--> ARMED (sync) or ACCUMULATING (no_sync) --backward--> REDUCING
         ^                                                                          |
         +------------------------- the reduction completes ------------------------+

An accumulating backward leaves the phase where it is; the next forward begins again. Until
its backward's first gradient arrives a forward's decision may still change (torch decides
when the forward returns; see :meth:`StepWindow.decide`).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    UNPREPARED = "unprepared"  # no forward through the wrapper since the last reduction
    ACCUMULATING = "accumulating"  # last forward ran under no_sync(): gradients stay local
    ARMED = "armed"  # last forward ran with sync on: the next backward reduces
    REDUCING = "reducing"  # inside that backward (or a join round): buckets are launched


class StepWindow:
    """The facts of one accumulation window (see [Note: the step window])."""

    def __init__(self, num_params: int, world_size: int) -> None:
        self.phase = Phase.UNPREPARED
        self.used = [False] * num_params  # got a gradient on this rank in this window
        # Ranks that contribute data to the coming reduction: fewer than the world once some
        # ranks have run out of data and joined (see join.py); they contribute zeros.
        self.num_active = world_size
        self.by_world = False  # a mean divides by the world, not num_active (torch's Join)
        self.forwards = 0  # training forwards in this window (see [Note: step tags])
        self.changes: list[str] = []  # how the parameter set differs from wrapping time
        self._settled_no_sync = 0  # training forwards before the last one that ran no_sync
        self._last_training = False  # the last forward ran in training mode
        self._backward_began = False  # a gradient of the last forward's backward arrived

    @property
    def open(self) -> bool:
        """A training forward ran since the last reduction: gradients of a step are pending."""
        return self.forwards > 0

    @property
    def no_sync(self) -> int:
        """Training forwards of this window whose backward accumulates locally."""
        return self._settled_no_sync + int(self._last_accumulates())

    def _last_accumulates(self) -> bool:
        return self._last_training and self.phase is Phase.ACCUMULATING

    def begin_forward(
        self, sync: bool, training: bool, num_active: int, by_world: bool, changes: list[str]
    ) -> None:
        """A grad-enabled forward began; the previous forward's decision is final now."""
        self._settled_no_sync += int(self._last_accumulates())
        self.num_active, self.by_world, self.changes = num_active, by_world, changes
        self.forwards += int(training)
        self._last_training, self._backward_began = training, False
        self.phase = Phase.ARMED if sync else Phase.ACCUMULATING

    def decide(self, sync: bool) -> None:
        """Whether the backward of the forward just begun reduces (``sync``) or accumulates:
        it may change until that backward's first gradient arrives (:meth:`backward_began`)."""
        if not self._backward_began and self.phase in (Phase.ARMED, Phase.ACCUMULATING):
            self.phase = Phase.ARMED if sync else Phase.ACCUMULATING

    def backward_began(self) -> bool:
        """The first gradient of an accumulating backward arrived: its decision is final.
        ``True`` the first time only (the reducer marks the phase boundary then)."""
        first = not self._backward_began
        self._backward_began = True
        return first

    def start_reduction(self) -> None:
        """The first gradient of a synchronised backward arrived."""
        self.phase = Phase.REDUCING

    def shadow(self, num_active: int, by_world: bool, changes: list[str]) -> None:
        """A rank that has joined takes part in the others' reduction with nothing used."""
        self.num_active, self.by_world, self.changes = num_active, by_world, changes
        self.used = [False] * len(self.used)
        self.phase = Phase.REDUCING
