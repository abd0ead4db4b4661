"""The training loop's side of recovery: steps that a lost rank does not end.

A training loop gains recovery by running each step inside the step objects that
:meth:`Recovery.steps` hands out::

    recovery = Recovery(model, optimizer, sampler, lr_scheduler=scheduler)
    for step in recovery.steps(max_steps):
        with step:                                      # a lost rank: the survivors redo it
            for x, y in step.micro_batches(loader):     # this rank's share of the global batch
                ...forward, backward (no_sync on all but the last)...
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

When a peer is lost inside a step, the collective that needed it raises on the survivors; the
``with`` block catches that (recognised by its type, ``notice.py``), and the survivors agree on
who goes on (``membership.py``), roll back to the start of the step (``rollback.py``), build new
groups in the same processes (``regroup.py``), re-split the same global batch over themselves,
and the loop hands out the same step again. Everything else the block raises goes on up,
unchanged.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.elastic import joining
from gradsync.errors import GradsyncError, UsageError, first_line
from gradsync.failfast.waiting import watch_for_regroups
from gradsync.recovery import heal, shares
from gradsync.recovery.collectives import stamped_all_reduce
from gradsync.recovery.coverage import check_covered
from gradsync.recovery.events import (
    Admitted,
    Change,
    Joined,
    Lost,
    log_admitted,
    log_fallback,
    log_lost,
)
from gradsync.recovery.heartbeat import Heartbeat
from gradsync.recovery.membership import (
    Membership,
    NoRecoveryError,
    Report,
    agree,
    announce,
    begun,
    begun_key,
    gather,
    publish_process,
)
from gradsync.recovery.notice import lost_a_peer, regroup_failed, where_noticed
from gradsync.recovery.regroup import close_groups, job_store, regroup
from gradsync.recovery.replicas import Replicas
from gradsync.recovery.rollback import StepStart
from gradsync.recovery.zero import steps_for

ADMIT_EVERY = 10  # steps between two looks for an offer to replacements (heal.py)


class Step:
    """One global step: a context manager that ends a lost rank's failure inside it."""

    def __init__(self, recovery: Recovery, number: int) -> None:
        self.recovery = recovery
        self.number = number  # steps completed before this one, over all epochs
        self.epoch, self.index = recovery.sampler.epoch, recovery.sampler.step
        self.entered = False
        self.completed = False  # False after the block if the step was interrupted: code
        # after ``with step:`` runs either way, and the loop then hands the step out again

    def micro_batches(self, loader: torch.utils.data.DataLoader) -> Iterator[Any]:
        """This rank's micro-batches of this step, read from ``loader``'s dataset and collated
        with its ``collate_fn`` (the loader's own iteration is not used: its sampler's split
        changes with the membership); one of no sample where this rank's share is empty, so
        that every rank runs every step (``shares.py``)."""
        shares.refuse_leafless_step(self.recovery.sampler, self.index, self.number)
        return shares.micro_batches(self.recovery.sampler, self.index, loader)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """``dist.all_reduce(tensor, op)`` over the current members, in place, for the loop's
        own agreements inside ``with step:`` (a loss to log, a vote to stop early). A peer lost
        meanwhile ends it at once, when another survivor has begun to regroup (torch's call
        would wait out the backend's timeout, and the job take the restart path). Ranks at
        different steps raise ``DesyncError`` (``collectives.py``)."""
        timeout = self.recovery.model.options.timeout
        return stamped_all_reduce(tensor, op, self.number, self.recovery, timeout)

    def __enter__(self) -> Step:
        self.recovery._begin(self)
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.recovery._completed(self)
            self.completed = True
            return False
        recovery = self.recovery  # a collective's error, or on a mesh a model's own (replicas.py)
        if lost_a_peer(exc) or recovery.replicas.lost_inside(exc, recovery.begun, recovery.window):
            recovery._recover(self, exc)
            return True  # the loop hands out the step to redo
        return False


class Recovery:
    """In-process recovery from lost ranks for a loop over :class:`GlobalBatchSampler` steps.

    Args:
        model: a :class:`gradsync.DistributedDataParallel` over the default process group, or
            over a device mesh's data-parallel axes ([Note: a mesh under Recovery]).
        optimizer: the optimizer stepped once per step; ZeRO-1's from ``model.shard_optimizer``
            is covered: each rank mirrors the next one's slices ([Note: ZeRO-1 under Recovery]).
        sampler: the :class:`GlobalBatchSampler` that defines every step's global batch.
        lr_scheduler: optional; rolled back with the step.
        checkpointer: optional; a :class:`~gradsync.checkpoint.Checkpointer` to carry over to
            the new membership (a save a lost rank interrupted is abandoned, then redone with
            its step).
        window: the longest the survivors wait for each other's answers after a loss (seconds);
            a member still beating but silent after it sends the job to the restart path, so
            set it above a step's longest stretch of compute without a collective.
        min_world_size: fewer survivors than this take the restart path instead.
        join: the ``host:port`` of a running job's store (its ``store_address``) to join as a
            replacement; by default ``GRADSYNC_JOIN``, if set ([Note: joining a running job]
            in ``heal.py``). The constructor then returns once admitted, with the job's state.
        join_timeout: the longest a replacement waits to be admitted (seconds).
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        sampler: GlobalBatchSampler,
        *,
        lr_scheduler: Any = None,
        checkpointer: Checkpointer | None = None,
        window: float = 1.0,
        min_world_size: int = 1,
        join: str | None = None,
        join_timeout: float = 3600.0,
    ) -> None:
        join = join if join is not None else joining()
        check_covered(model, optimizer, sampler, join)
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.lr_scheduler, self.checkpointer = lr_scheduler, checkpointer
        self.window, self.min_world_size = window, min_world_size
        # steps completed, over all epochs (a sampler loaded from a checkpoint says how many)
        self.completed = sampler.epoch * sampler.steps_per_epoch + sampler.step
        self._compared_at = self.completed  # the step whose forward compared the first batches
        self.optimizer_steps = steps_for(model, optimizer)  # ZeRO-1: its mirrors (zero.py)
        self.replicas = Replicas(model, sampler)  # what a loss takes whole (a mesh's replicas)
        self.replicas.commit_steps(self.optimizer_steps, weakref.proxy(self), model.options.timeout)
        weakref.finalize(self, self.optimizer_steps.remove)  # its hooks serve this object alone
        self._starts: dict[int, StepStart] = {}
        # kept: it outlives every group; a replacement joins with GRADSYNC_JOIN=store_address
        self.store, self.store_address = job_store(join)
        # beats from now on; watches the next member inside steps ([Note: heartbeats])
        self.heartbeat = Heartbeat(self.store)
        weakref.finalize(self, self.heartbeat.close)
        self.changes: list[Change] = []  # one record per membership change (events.py)
        self._redoing: int | None = None  # the change whose redone step is under way
        self._offer: heal.Offer | None = None  # the admission offered to replacements
        self._next_poll = 0.0  # when rank 0 next looks for replacements' tickets
        watch_for_regroups(self)  # held weakly: deadlines stop watching once this object goes
        if join:
            self._join(join_timeout)
            return
        self.membership = Membership(0, tuple(range(dist.get_world_size())), dist.get_rank(), {})
        # This job's keys in the store, drawn by rank 0: a store can outlive a torchrun restart,
        # and torchrun's restart count differs from one agent to another.
        token = [os.urandom(8).hex()]
        dist.broadcast_object_list(token, group_src=0)
        self._namespace = token[0]
        self._publish()
        scope, timeout = self._generation_key(), self.model.options.timeout
        gather(self.store, scope, "started", self.membership.world_size, timeout)

    @property
    def events(self) -> list[dict[str, Any]]:
        """:attr:`changes` as JSON-ready dicts, one per membership change, with its timings."""
        return [change.as_dict() for change in self.changes]

    def begun(self) -> bool:
        """Whether a survivor has begun to regroup this generation (for the deadlines)."""
        return begun(self.store, self._generation_key())

    def _generation_key(self) -> str:
        return f"{self._namespace}/{self.membership.generation}"

    def steps(self, max_steps: int | None = None, epochs: int | None = None) -> Iterator[Step]:
        """The steps to run, each as a :class:`Step` to enter with ``with``: until ``max_steps``
        steps are completed (over all epochs), or the end of epoch ``epochs - 1``. A step a lost
        rank interrupted comes again, over the survivors."""
        if self.heartbeat.closed:  # steps() again, after the end of an earlier loop
            self.heartbeat = Heartbeat(self.store)
            weakref.finalize(self, self.heartbeat.close)
            self._publish()
        while max_steps is None or self.completed < max_steps:
            if self.sampler.step >= self.sampler.steps_per_epoch:
                if epochs is not None and self.sampler.epoch + 1 >= epochs:
                    return
                self.sampler.set_epoch(self.sampler.epoch + 1)
            self._admit_replacements()
            step = Step(self, self.completed)
            yield step
            if not step.entered:
                raise UsageError("run every step of Recovery.steps() inside `with step:`")
        self.heartbeat.finish()  # peers still in the last step see it finished, not dead
        if self.membership.rank == 0:
            heal.close(self.store)  # replacements still waiting would wait for nothing

    # -- the step's bookkeeping -----------------------------------------------------------------
    def _begin(self, step: Step) -> None:
        step.entered = True
        self.heartbeat.watching = True
        start = StepStart.take(self.model.module, self.optimizer, self.lr_scheduler, self.sampler)
        self._starts = {n: s for n, s in self._starts.items() if n == step.number - 1}
        self._starts[step.number] = start
        self.optimizer_steps.begin(step.number)
        self.model.reducer.loop_step = step.number  # rides in the step tags (checks/tags.py)
        # The sampler's own rule: a step is counted once its micro-batches are handed out, so a
        # checkpoint saved inside the step resumes at the next one.
        self.sampler.step = step.index + 1

    def _completed(self, step: Step) -> None:
        self.heartbeat.watching = False
        self.completed = step.number + 1
        self.optimizer_steps.end()
        if self._redoing is not None:
            lost = self.changes[self._redoing]
            assert isinstance(lost, Lost)
            lost = replace(lost, redone_s=time.time() - lost.regrouped)
            self.changes[self._redoing], self._redoing = lost, None
            log_lost(lost)

    # -- recovery -------------------------------------------------------------------------------
    def _recover(self, step: Step, exc: BaseException) -> None:
        """Survive the loss that ``exc`` reports, or raise why not (the restart path)."""
        noticed = time.time()
        self.heartbeat.watching = False
        me, steps = self.membership, self.optimizer_steps
        steps.end()
        phase = where_noticed(self.model, steps.stepped_in == step.number, exc)
        report = Report(self.completed, phase, steps.stepped_in)
        try:
            announce(self.store, self._generation_key())  # wakes survivors still waiting
            backend = close_groups(self.replicas.inner_groups())  # wakes a peer waiting there
            new, lost = agree(self.store, self._generation_key(), me, report, self.window)
            agreed = time.time()
            target = min(r.done for r in new.reports.values())
            self._check_can_go_on(new, target, lost)
            self.optimizer.zero_grad(set_to_none=True)
            self._regroup_to(new, backend)
            # the step's result, where a survivor holds it ([Note: rolling a step back])
            steps.settle(target, new.reports, new.members, self.model.module)
            self._starts[target].restore(
                self.model.module, self.optimizer, self.lr_scheduler, self.sampler
            )
            self._continue_on_the_new_group(compared=target > self._compared_at)
        except GradsyncError as error:
            log_fallback(self.membership.rank, step.number, error)
            raise error from exc
        except Exception as error:  # the store or a new connection failed
            reason = regroup_failed(error, self.store_address)
            log_fallback(self.membership.rank, step.number, reason)
            raise reason from exc
        self.completed = target
        self._redoing = len(self.changes)  # logged once the redone step completes
        self.changes.append(
            Lost(
                new.generation,
                tuple(sorted(lost)),
                target,
                phases=tuple(sorted({r.phase for r in new.reports.values()})),
                world_size=new.world_size,
                rank=new.rank,
                noticed=noticed,
                agreed=agreed,
                regrouped=time.time(),
                error=f"{type(exc).__name__}: {first_line(exc, default='')[:300]}",
            )
        )

    def _regroup_to(self, new: Membership, backend: str) -> None:
        self.membership, self._offer = new, None
        scope, timeout = self._generation_key(), self.model.options.timeout
        self._publish()  # before the new group: every member has, once it is up
        regroup(self.store, scope, new.rank, new.world_size, backend, timeout)
        self.replicas.regroup(new.members)

    def _publish(self) -> None:
        """This process and its heartbeat, under the current generation's keys."""
        scope, me = self._generation_key(), self.membership
        publish_process(self.store, scope, me.rank)
        self.heartbeat.beat_as(scope, me.rank, me.world_size, begun_key(scope))

    def _continue_on_the_new_group(self, from_rank_0: bool = False, compared: bool = False) -> None:
        """The wrapper (its replicas checked equal, or made rank 0's), the checkpointer and
        the sampler, over the new default group. ``compared``: every survivor completed the
        step in which the first batches were compared (an agreed fact: it skips the check)."""
        self.model.regroup(from_rank_0, first_batches_compared=compared)
        if self.checkpointer is not None:
            self.checkpointer.regroup()
        self.sampler.reshard(*self.replicas.share(self.membership))

    # -- healing ([Note: joining a running job] in heal.py) ------------------------------------
    def _join(self, timeout: float) -> None:
        """As a replacement: wait to be admitted, then take a live peer's state."""
        ticket = heal.ask(self.store)
        asked = time.time()
        admission = heal.wait_for_admission(self.store, ticket, timeout)
        admitted = time.time()
        backend = close_groups()  # the replacement's own torchrun group
        self._namespace = admission.namespace
        members = tuple(range(admission.members))
        rank = admission.rank_of(ticket)
        new = Membership(admission.generation, members, rank, {}, admission.tickets)
        self._regroup_to(new, backend)
        self._take_state(receive=True)
        self.changes.append(
            Joined(
                new.generation,
                new.joined,
                self.completed,
                world_size=new.world_size,
                rank=new.rank,
                asked=asked,
                admitted=admitted,
                switched=time.time(),
            )
        )

    def _admit_replacements(self) -> None:
        """At a step's start: offer waiting replacements a step, or admit them at it."""
        scope, me, every = self._generation_key(), self.membership, ADMIT_EVERY
        if me.rank == 0 and self._offer is None and time.monotonic() > self._next_poll:
            self._next_poll = time.monotonic() + 1.0  # two store reads a second
            tickets = heal.waiting(self.store)
            if tickets:  # members look every `every` steps: all have seen it by then
                at = (self.completed // every + 2) * every
                heal.offer(self.store, scope, heal.Offer(at, tickets))
        if self._offer is None and self.completed % every == 0:
            self._offer = heal.offered(self.store, scope)  # one store read per `every` steps
        if self._offer is None or self._offer.step != self.completed:
            return
        start, tickets = time.time(), self._offer.tickets
        new = Membership(me.generation + 1, tuple(range(me.world_size)), me.rank, {}, tickets)
        asked = None
        if me.rank == 0:
            admission = heal.Admission(self._namespace, new.generation, me.world_size, tickets)
            heal.admit(self.store, admission)
            asked = heal.asked(self.store, tickets)
        self._regroup_to(new, close_groups())
        regrouped = time.time()
        self._take_state(receive=False)
        admitted = Admitted(
            new.generation,
            tickets,
            self.completed,
            world_size=new.world_size,
            rank=new.rank,
            started=start,
            asked=asked,
            regrouped=regrouped,
            switched=time.time(),
        )
        self.changes.append(admitted)
        log_admitted(admitted)

    def _take_state(self, receive: bool) -> None:
        """Rank 0's training state onto every rank (``receive``: load it here), then go on."""
        small: dict[str, Any] = {"completed": self.completed, "sampler": self.sampler.state_dict()}
        small = heal.transfer_state(self.optimizer, self.lr_scheduler, small, receive)
        if receive:
            self.completed = small["completed"]
            self.sampler.load_state_dict(small["sampler"])
        self._compared_at = self.completed  # every rank compares its first batches again
        self._continue_on_the_new_group(from_rank_0=True)

    def _check_can_go_on(self, new: Membership, target: int, lost: dict[int, Any]) -> None:
        replicas = self.replicas.left_after(set(lost), new.world_size)
        why = None
        if new.world_size < self.min_world_size:
            why = f"{new.world_size} rank(s) left, fewer than min_world_size={self.min_world_size}"
        elif replicas > self.sampler.global_batch_size:
            why = "more replicas than samples in a global batch"
        elif target not in self._starts:
            why = f"step {target}'s start is not kept on rank {new.rank} (a step behind)"
        if why:
            raise NoRecoveryError(f"lost rank(s) {sorted(lost)} but cannot go on: {why}")
