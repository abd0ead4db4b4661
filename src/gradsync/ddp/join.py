"""Uneven data: ranks that run out of batches keep answering until every rank is done.

Without this, the rank with one batch more waits forever in its gradient all-reduce. Inside
``with model.join():`` every training forward starts with a tiny handshake, an all-reduce of
``[active, syncing, broadcasting]``. A rank that has left its loop answers ``[0, 0, 0]`` in a
loop: for each round in which others are still active, it issues the same collectives they do
(buffer broadcast, item count, bucket all-reduces) with zero gradients, zero used-flags, no step
tag and zero items, so the others' reductions complete and average over the ranks that still
had data. When a handshake sums to zero, all ranks are done.

With ``model.join(optimizer)`` the waiting rank also applies each round's reduced gradients:
``zero_grad(); step(); zero_grad()``, the part of the loop body it can know. The rest of the
body (an LR scheduler, clipping) does not run there, which the end of the join detects and
warns about ([Note: what a join round cannot repeat] in ``checks/join_exit.py``); the exact
loop gives every rank every step instead, and needs no join for a short last global batch.

The protocol runs on gradsync's private process group (``failfast/group.py``), so a collective
the active ranks issue on their own group (a logging all_reduce, say) can never be matched with a
handshake: the waiting rank reaches its deadline and raises, naming what it waited for, instead
of mixing unrelated tensors. The ranks with data are then left in their own collective, which
fails in the backend once the waiting rank gives up; leaving ``model.join(optimizer)`` turns that
error into gradsync's, quoting the waiting rank's record (``foreign_collective_error``).

torch's own ``Join`` context manager (``torch.distributed.algorithms.join``) drives the same
protocol through the hook of :meth:`JoinProtocol.torch_hook`: torch counts the ranks still
active with its own all-reduce and calls the hook's ``main_hook`` once per round on each rank
that has joined, which answers one handshake (:meth:`JoinProtocol.serve_round`). The
differences from ``model.join(opt)`` are torch's: no optimizer steps on a joined rank (its
parameters are replaced at the end, its optimizer state is left behind), and gradients are
divided by the whole world size unless ``divide_by_initial_world_size=False``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync.ddp.checks.join_exit import (
    WAITING,
    foreign_collective_error,
    warn_if_served_rounds_differ,
)
from gradsync.ddp.reducer import Reducer
from gradsync.errors import GradsyncError, UsageError
from gradsync.failfast.deadline import Deadline


class Rounds(Protocol):
    """What a join acts on: the wrapper's state (``state.py``), as the protocol sees it."""

    reducer: Reducer

    def broadcast_buffers(self, src: int = 0) -> None: ...

    def take_final_state(self) -> None: ...


class JoinProtocol:
    """The handshake (one all-reduce of three int64 per training forward), and whether this
    wrapper is inside a join: ``model.join(optimizer)`` or torch's ``Join``."""

    def __init__(self, deadline: Deadline, handshake_each_forward: bool = True) -> None:
        self.deadline = deadline
        self.handshake_each_forward = handshake_each_forward  # the mode's: see due()
        self.rounds_active = 0  # handshakes this rank answered with data
        self.rounds_served = 0  # rounds of the others' steps this rank stepped in without data
        self.stepping = False  # inside model.join(optimizer)
        self.divides_by_world = False  # torch's Join(divide_by_initial_world_size=True)
        self.ran_out = 0  # ranks out of data at this rank's last handshake, inside a join

    def joining(self, joinable: Joinable) -> bool:
        """Inside ``model.join(optimizer)``, or inside torch's ``Join`` (which enables the
        ``_join_config`` of ``joinable``, the wrapper)."""
        return self.stepping or joinable._join_config.enable

    def waiting(self, joinable: Joinable) -> int:
        """How many ranks wait in the join for lack of data (as of the last handshake): a save
        inside a join is whole between steps that every rank runs, and refused after that."""
        return self.ran_out if self.joining(joinable) else 0

    def due(self, sync: bool) -> bool:
        """Whether a training forward with ``sync`` answers the handshake: every one, or in the
        deterministic mode the synchronised ones ([Note: leaves and join])."""
        return sync or self.handshake_each_forward

    def handshake(self, active: bool, sync: bool, broadcast: bool) -> tuple[int, bool, bool]:
        """(ranks still active, will they reduce, will they broadcast buffers) for this round."""
        flags = [int(active), int(active and sync), int(active and broadcast)]
        t = torch.tensor(flags, dtype=torch.int64, device=self.deadline.device)
        what = (
            "the join handshake (this rank is active)"
            if active
            else "the join handshake: this rank ran out of data and waits for the others' next "
            "training forward"
        )
        self.deadline.all_reduce(t, what)
        self.rounds_active += int(active)
        num_active, syncing, broadcasting = t.tolist()
        self.ran_out = self.deadline.world_size - num_active
        return num_active, syncing > 0, broadcasting > 0

    def active_round(self, sync: bool, broadcast: bool) -> int:
        """An active rank's handshake; returns how many ranks are still active."""
        num_active, _, _ = self.handshake(True, sync, broadcast)
        return num_active

    def serve_round(self, state: Rounds, optimizer: torch.optim.Optimizer | None) -> bool:
        """Answer one round of the active ranks' collectives; ``False`` once none is active.
        Without an ``optimizer`` the reduced gradients are not applied here (torch's Join)."""
        self.deadline.begin(WAITING)
        # Now, not once a wait lasts: a collective of the loop's own fails on the ranks with
        # data at once, and their error reads this record to say why (``join_exit.py``).
        self.deadline.arrivals.publish()
        num_active, syncing, broadcasting = self.handshake(False, False, False)
        if num_active == 0:
            return False
        if broadcasting:
            state.broadcast_buffers()
        if syncing:
            if optimizer is not None:
                optimizer.zero_grad()
            write_back = optimizer is not None
            state.reducer.shadow_backward(num_active, write_back, self.divides_by_world)
            if optimizer is not None:
                optimizer.step()
                # As the loop's zero_grad() after its step: gradients left in .grad would be
                # added to this rank's next backward after the join (the next epoch's first
                # step), into every rank's reduced gradient. Before a loop that zeroes before
                # its backward instead, this is a no-op.
                optimizer.zero_grad()
                self.rounds_served += 1
        return True

    def join(
        self,
        state: Rounds,
        joinable: Joinable,
        optimizer: torch.optim.Optimizer | None,
        divide_by_initial_world_size: bool,
        enable: bool,
        throw_on_early_termination: bool,
    ) -> AbstractContextManager[Any]:
        """Train on uneven data: ranks that finish their batches early wait for the rest.

        ``with model.join(optimizer):`` is gradsync's exact form. While waiting, a rank takes
        part in every reduction of the others with zero weight and applies the reduced
        gradients with ``optimizer``, so its parameters and optimizer state stay in step;
        means are over the ranks that still had data, so training equals one process trained
        on exactly the batches that existed. At the end every rank takes the parameters and
        buffers of a rank that was active last. Step logic beyond ``optimizer.step()`` and
        ``zero_grad()`` (gradient clipping, LR schedulers) does not run on waiting ranks: the
        end of the join warns, on every rank, when a waiting rank's optimizer hyperparameters
        or parameters then differ ([Note: what a join round cannot repeat]).

        ``with model.join():`` (no optimizer) is torch DDP's, with torch's semantics: the same
        as ``torch.distributed.algorithms.join.Join([model], enable,
        throw_on_early_termination, divide_by_initial_world_size=...)``.
        """
        if optimizer is None:
            return Join(
                [joinable],
                enable,
                throw_on_early_termination,
                divide_by_initial_world_size=divide_by_initial_world_size,
            )
        if not callable(getattr(optimizer, "step", None)):
            raise UsageError(
                f"join() takes the optimizer whose steps a waiting rank repeats, got "
                f"{type(optimizer).__name__}; torch DDP's arguments are keyword-only here, e.g. "
                "join(divide_by_initial_world_size=False)"
            )
        return self._stepping(state, optimizer)

    @contextmanager
    def _stepping(self, state: Rounds, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """``model.join(optimizer)``: answer every round of the others after this rank's loop
        ends, then take the final state."""
        self.rounds_active, self.rounds_served, self.stepping = 0, 0, True
        self.ran_out = 0
        try:
            yield
        except BaseException as exc:
            self.stepping = False  # on an error, leave without waiting for the others
            error = foreign_collective_error(exc, self.deadline)
            if error is None:
                raise
            self.deadline.record_error(error)
            raise error from exc
        try:
            while self.serve_round(state, optimizer):
                pass
            params = state.reducer.params
            warn_if_served_rounds_differ(self.deadline, optimizer, self.rounds_served, params)
            state.take_final_state()
        except GradsyncError as exc:
            self.deadline.record_error(exc)  # so that a peer's error can quote this verdict
            raise
        finally:
            self.stepping = False

    def torch_hook(
        self, state: Rounds, joinable: Joinable, divide_by_initial_world_size: bool = True
    ) -> JoinHook:
        """The hook torch's ``Join`` drives for ``joinable``: torch counts the active ranks with
        its own all-reduce, so each ``main_hook`` answers exactly one round."""
        self.rounds_active, self.divides_by_world = 0, bool(divide_by_initial_world_size)
        self.ran_out = 0
        return _TorchJoinHook(self, state, joinable)

    def authoritative_rank(self) -> int:
        """A rank that was active in the last round (the highest such): its state is final."""
        world = self.deadline.world_size
        t = torch.tensor(
            [self.rounds_active * world + self.deadline.rank],
            dtype=torch.int64,
            device=self.deadline.device,
        )
        self.deadline.all_reduce(t, "the end of join (choosing the final state)", dist.ReduceOp.MAX)
        return int(t.item()) % world


class _TorchJoinHook(JoinHook):
    """Held by torch's ``Join`` for the length of one context."""

    def __init__(self, protocol: JoinProtocol, state: Rounds, joinable: Joinable) -> None:
        self.protocol, self.state, self.joinable = protocol, state, joinable

    def main_hook(self) -> None:
        self.protocol.serve_round(self.state, None)

    def post_hook(self, is_last_joiner: bool) -> None:
        # Leaving torch's Join (on every rank): its config back to disabled, so later forwards
        # outside the context do not handshake.
        Joinable.__init__(self.joinable)
        self.protocol.divides_by_world = False
        self.state.take_final_state()
