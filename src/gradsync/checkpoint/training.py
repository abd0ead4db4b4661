"""``Checkpointer``: save and load everything a data-parallel job needs to continue exactly.

One call saves the model, optimizer, LR scheduler, gradsync's step counter, each rank's data
position and each rank's RNG states with ``torch.distributed.checkpoint`` (DCP: every rank
writes its part in parallel, replicated tensors once); one call loads the newest checkpoint
that is complete and verifies, naming and skipping the others. The folder layout, the commit
and the checksums are in ``folder.py``; what is saved is in ``state.py``.

Collectives run on a gloo group of the checkpointer's own, under its own deadline: an
asynchronous save's collectives, on a background thread, then never interleave with the
training loop's, and a rank that died mid-save fails the others instead of hanging them.
"""

from __future__ import annotations

import os
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from gradsync.checkpoint import owner
from gradsync.checkpoint.dcp_safe import SafeFileSystemReader, SafeLoadPlanner
from gradsync.checkpoint.folder import (
    CheckpointFolder,
    check_files,
    digest,
    my_share,
    read_manifest,
)
from gradsync.checkpoint.loadable import check_loadable
from gradsync.checkpoint.state import TrainingObjects, mismatches, refuse_resize, snapshot
from gradsync.ddp.compat.state_keys import RanksOutOfData
from gradsync.elastic import joining
from gradsync.errors import CheckpointError, CollectiveTimeoutError, ProtocolError, UsageError
from gradsync.failfast.deadline import Deadline, as_timedelta
from gradsync.failfast.waiting import regroup_begun, watching
from gradsync.optim.master import MasterWeights


class Checkpointer:
    """Training checkpoints in ``folder``: ``save(step)``, ``async_save(step)``, ``load()``.

    Construct it on every rank (it creates a process group). Args:
        folder: one folder per job (shared by all ranks), holding ``step_N`` sub-folders.
        model: the model, usually a ``gradsync.DistributedDataParallel``.
        optimizer, lr_scheduler: optional; saved and restored when given.
        sampler: optional ``gradsync.data.DistributedSampler`` (anything with
            ``state_dict()``/``load_state_dict()``): each rank's data position.
        keep: how many committed checkpoints to keep (``None``: all).
        timeout: deadline of each checkpoint collective.

    Partial folders of saves that never committed (a job killed mid-save) are removed here.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | MasterWeights | None = None,
        lr_scheduler: Any = None,
        sampler: Any = None,
        keep: int | None = 3,
        timeout: float | timedelta = 600.0,
    ) -> None:
        if not dist.is_initialized():
            raise ProtocolError("Checkpointer needs torch.distributed initialised first")
        if keep is not None and keep < 1:
            raise UsageError(f"keep must be >= 1 or None, got {keep}")
        self.folder = CheckpointFolder(folder)
        self.objects = TrainingObjects(model, optimizer, lr_scheduler, sampler)
        self.keep = keep
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Its own gloo group (DCP writes from CPU whatever training uses), under a deadline:
        # a rank that dies or never comes is named, as in the wrapper's collectives.
        self._deadline = _new_deadline(as_timedelta(timeout))
        self._group = self._deadline.group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None  # the last async snapshot, refilled by the next one
        if joining():  # a replacement: the job it joins holds the folder and its partials
            owner.join(self.folder.root)
            return
        self._claim_folder()
        if self.rank == 0:
            for path in self.folder.remove_partials():
                warnings.warn(
                    f"gradsync: removed {path}: a checkpoint save that never committed "
                    "(the job was stopped while writing it)",
                    stacklevel=2,
                )
        self._agree("the construction of a Checkpointer")

    def _agree(self, what: str) -> None:
        """Every rank reaches ``what`` (a barrier under the deadline)."""
        self._deadline.begin(what)
        self._deadline.all_reduce(torch.zeros(1), what)

    def _gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (``all_gather_object`` under the deadline)."""
        self._deadline.begin(what)
        return self._deadline.gather_objects(obj, what)

    def _claim_folder(self) -> None:
        """Rank 0 takes the folder for this job, then the other ranks hold it too; a folder
        another job holds is refused on every rank, before anything is written or removed (see
        [Note: a folder belongs to one job] in ``owner.py``). The claim lasts as long as the
        job's processes."""
        problem = None
        if self.rank == 0:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            problem = _claimed(owner.claim, self.folder.root)
        verdict = self._gather(problem, f"the claim of {self.folder.root} by rank 0")[0]
        if verdict is not None:
            raise CheckpointError(verdict)
        self._hold_folder("the claim")

    def _hold_folder(self, what: str) -> None:
        """Every rank holds the folder as a process of this job (rank 0's claim is kept)."""
        problem = _claimed(owner.join, self.folder.root)
        problems = self._gather(problem, f"{what} of {self.folder.root} by every rank")
        found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if found:
            raise CheckpointError("; ".join(found))

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Save the training state of ``step`` and return its folder once it is committed."""
        self.wait()
        state = self._checked_state(step)
        if not watching():
            return self._write(state, step)
        # Under in-process recovery DCP's collectives, which no deadline watches, run on a
        # thread, so that a rank lost mid-save does not hold this one until their timeout.
        self._start_write(state, step)
        self.wait()
        return self.folder.step_dir(step)

    def async_save(self, step: int) -> None:
        """Copy the training state to CPU memory, then write it on a background thread.

        Returns as soon as the copy is taken, so training may change the live tensors; the
        stall is the copy. The copy's memory is kept and refilled by the next call. The next
        ``save``, ``async_save``, ``load`` or :meth:`wait` waits for the write to commit and
        raises its error, if any, on every rank.
        """
        self.wait()  # the previous snapshot is written: its memory can be refilled
        state = snapshot(self._checked_state(step), reuse=self._staging)
        self._staging = state
        self._start_write(state, step)

    def _start_write(self, state: dict[str, Any], step: int) -> None:
        self._thread = threading.Thread(
            target=self._write_in_background, args=(state, step), name="gradsync-checkpoint"
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for an asynchronous save to commit; raise its error if it failed."""
        thread, self._thread = self._thread, None
        while thread is not None and thread.is_alive():
            thread.join(0.05)
            if regroup_begun():  # a rank was lost: the write is abandoned (gradsync.recovery)
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: a rank was lost while a checkpoint was being written; "
                    "the write is abandoned (its folder stays partial)"
                )
        error, self._error = self._error, None
        if error is not None:
            raise error

    def regroup(self) -> None:
        """Go on over the new default group after a membership change (``gradsync.recovery``):
        a private group of the new members; a save that never committed is removed."""
        self._thread, self._error = None, None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # named the same on every member and replacement: the generation's store is its own
        name, timeout = "the regrouped Checkpointer", self._deadline.timeout
        self._deadline = Deadline.for_group(None, timeout, name, backend="gloo")
        self._group = self._deadline.group
        self._hold_folder("the regroup")  # the survivors hold it; a replacement joined it
        if self.rank == 0:
            self.folder.remove_partials()
        self._agree("the regroup of a Checkpointer")

    def _write_in_background(self, state: dict[str, Any], step: int) -> None:
        try:
            self._write(state, step)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = self._typed(exc, step)

    def _typed(self, exc: BaseException, step: int) -> BaseException:
        """The write's error as the training thread sees it. DCP's own collectives run on the
        write's thread, where no deadline waits on them, and gloo raises a plain
        ``RuntimeError`` when a peer is lost in one: typed here, as a deadline would
        (``CollectiveTimeoutError`` naming this rank and the write); anything else as raised
        (a full disk is an ``OSError``)."""
        if type(exc) is not RuntimeError:
            return exc
        error = CollectiveTimeoutError(
            f"rank {self.rank}: a collective of the checkpoint write of step {step} failed "
            f"(a rank lost, or the backend failing): {exc}"
        )
        error.__cause__ = exc
        return error

    def _checked_state(self, step: int) -> dict[str, Any]:
        """The state to save, refused on every rank if any rank's could not be loaded back."""
        if not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, got {step!r}")
        problem = None
        try:
            state = self.objects.state_dict(self.rank)
            check_loadable(state, f"checkpoint of step {step}", key="state", any_tensor=True)
        except RanksOutOfData:
            raise  # every rank here raises it; the ranks out of data would never agree
        except (UsageError, ProtocolError) as exc:
            problem = f"rank {self.rank}: {str(exc).removeprefix('gradsync: ')}"
        problems = self._gather(problem, f"the check before saving step {step}")
        found = [p for p in problems if p]
        if found:
            raise UsageError("nothing was saved: " + "; ".join(found))
        return state

    def _write(self, state: dict[str, Any], step: int) -> Path:
        partial = self.folder.partial_dir(step)
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=True, sync_files=True)
        dcp.save(state, storage_writer=writer, process_group=self._group)
        # Every rank has written its file and rank 0 the metadata: hash them in parallel.
        names = [p.name for p in partial.iterdir()]
        mine = {n: digest(partial / n) for n in my_share(names, self.rank, self.world_size)}
        shares = self._gather(mine, f"the file hashes of step {step}")
        outcome = None
        if self.rank == 0:
            outcome = self._commit(partial, step, {k: v for s in shares for k, v in s.items()})
        outcome = self._gather(outcome, f"the commit of step {step}")[0]
        if outcome.startswith("error: "):
            raise CheckpointError(f"checkpoint of step {step} was not committed: {outcome}")
        return Path(outcome)

    def _commit(self, partial: Path, step: int, files: dict[str, Any]) -> str:
        try:
            path = self.folder.commit(partial, step, self.world_size, files)
            self.folder.rotate(self.keep)
        except OSError as exc:
            return f"error: {exc}"
        return str(path)

    # -- loading --------------------------------------------------------------------------
    def load(self, path: str | os.PathLike[str] | None = None) -> int | None:
        """Restore the newest committed checkpoint that verifies, or the one at ``path``.

        Returns its step, or ``None`` when the folder holds no checkpoint (a fresh start).
        A newest checkpoint that is corrupted (a checksum differs, a file is truncated or
        missing) is skipped with a warning naming it and the problem, and the next older one
        is tried; ``path`` is not: it raises :class:`~gradsync.errors.CheckpointError`. A
        checkpoint of a different model or world size raises on every rank.
        """
        self.wait()
        if path is not None:
            problems = self._verify(Path(path))
            if problems:
                raise CheckpointError("\n".join(problems))
            return self._load(Path(path))
        mine = self.folder.committed() if self.rank == 0 else None
        entries = self._gather(mine, "the list of committed checkpoints")[0]
        skipped: list[str] = []
        for entry in entries:
            problems = self._verify(entry.path)
            if not problems:
                return self._load(entry.path)
            skipped += problems
            if self.rank == 0:
                warnings.warn(
                    f"gradsync: skipping checkpoint {entry.path}: " + "; ".join(problems),
                    stacklevel=2,
                )
        if skipped:
            raise CheckpointError(
                f"no checkpoint in {self.folder.root} verifies:\n  " + "\n  ".join(skipped)
            )
        return None

    def _verify(self, path: Path) -> list[str]:
        """Every problem of checkpoint ``path``, the same list on every rank."""
        try:
            files = read_manifest(path)["files"]
            problems = check_files(path, files, my_share(list(files), self.rank, self.world_size))
        except ValueError as exc:
            problems = [str(exc)]
        gathered = self._gather(problems, f"the verification of {path}")
        return sorted({p for ps in gathered for p in ps})

    def _load(self, path: Path) -> int:
        manifest = read_manifest(path)
        saved_world, step = int(manifest["world_size"]), int(manifest["step"])
        resized = saved_world != self.world_size
        reader = SafeFileSystemReader(str(path))
        metadata = reader.read_metadata()
        if resized:  # see [Note: resuming at another world size] in state.py
            refuse_resize(path, saved_world, self.world_size, metadata, self.objects.sampler)
        saved_keys = metadata.state_dict_metadata
        template = self.objects.state_dict(self.rank, saved_keys, resized=resized)
        problems = mismatches(template, metadata)
        gathered = self._gather(problems, f"the check before loading {path}")
        if any(gathered):
            found = next(p for p in gathered if p)
            raise CheckpointError(
                f"{path} was saved from a different model, optimizer or settings:\n  "
                + "\n  ".join(found)
            )
        dcp.load(
            template, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self._group
        )
        self.objects.load_state_dict(template, self.rank, str(path), resized=resized)
        if resized and self.rank == 0:
            warnings.warn(
                f"gradsync: the world size changed from {saved_world} to {self.world_size} at "
                f"step {step} ({path}); random numbers drawn per rank (dropout) do not follow "
                "the samples to other ranks, so only a model that draws none continues exactly",
                stacklevel=3,
            )
        return step


def _claimed(take: Any, root: Path) -> str | None:
    """What ``take(root)`` (``owner.claim`` or ``owner.join``) raised, if anything."""
    try:
        take(root)
    except CheckpointError as exc:
        return str(exc).removeprefix("gradsync: ")
    return None


_num_checkpointers = 0  # built in this process: the same sequence on every rank


def _new_deadline(timeout: timedelta) -> Deadline:
    """The deadline (and private gloo group) of the next Checkpointer built in this process."""
    global _num_checkpointers
    _num_checkpointers += 1
    name = f"Checkpointer #{_num_checkpointers}"
    return Deadline.for_group(None, timeout, name, backend="gloo")
