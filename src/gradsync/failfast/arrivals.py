"""Where each rank was last seen: arrival records in the process group's key-value store.

A collective that times out only tells the waiting rank that *someone* did not come; gloo's
message names no rank ("Connection closed by peer", or a timeout). So that every survivor can
say *which* rank is missing and where it was last seen, each rank keeps one small record of
the gradsync operation it has started, ``"<sequence>|<unix time>|<process>|<what>"``, and puts
it in the c10d store (the rendezvous store every process group already has) under a key per
global rank when its peers may need it. The sequence number counts gradsync's operations on
the group, which every rank runs in the same order, so a rank whose record is behind the
reader's never arrived. This follows torch's flight recorder for NCCL, which keeps per-rank
collective records for the same purpose.

[Note: records written when waiting]
A record is read only after a failure, by a rank that waited: at its deadline, or when a peer
went away. So a rank writes its record when one of its waits outlasts a moment
(``waiting.SLOW_S``), at construction, and when it fails or raises; a step whose collectives
are quick writes nothing. A store write every step cost each rank a round of the store's
thread (four ranks sharing two cores: 4 % of a host-bound step) and would cost the store's
host N writes a step. Two things follow for the reader:
- A rank that has not written its record for this operation is not waiting in it. What the
  reader knows of it besides its record: it took part in the last collective that needed
  every rank and ended here (:meth:`ArrivalRecords.took_part`), so it was last seen there at
  the latest, which is what a record written every step would say of a rank that never came.
- A rank killed before it waited in the operation (in its backward) is named as dead with
  that place, not as dead inside the operation: it had not written that it was there.

A rank that died *inside* a collective has a record like everyone's. So each record also names
the process that wrote it (``liveness.py``), and after a failure the survivors hold a roll call:
:meth:`ArrivalRecords.after_failure` names the dead ("rank 2 died inside it (its process 1234
on host h is gone)"), the silent and the living, within a bound even if the store hangs.

Reads happen only on the error path, and only for keys that exist (``check`` first), so a rank
that never wrote cannot make the reader block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gradsync.errors import first_line
from gradsync.failfast.liveness import Fate, ProcessId, find_dead, roll_call, this_process

_PREFIX = "gradsync/last_seen/"
_NO_STORE = "(no arrival records: this job has no c10d store)"
# How much longer than its roll call a reading of the store may take before it is given up
# (a store whose host died without closing its connections answers nothing, for minutes).
_STORE_GRACE_S = 0.5


class Record(NamedTuple):
    """One rank's last arrival record."""

    seq: int
    stamp: float  # unix time
    what: str
    process: ProcessId | None  # who wrote it: the roll call looks it up


class ArrivalRecords:
    """This rank's record writer and everyone's record reader, for one process group.

    ``namespace`` keeps apart the records of different users of the same ranks (two wrappers,
    ``any_rank``); it must be the same string on every rank.
    """

    def __init__(self, group: dist.ProcessGroup | None, namespace: str) -> None:
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        self.global_ranks = dist.get_process_group_ranks(pg)
        self.rank = dist.get_rank(group)
        self.namespace = f"{_PREFIX}{pg.group_name}/{namespace}/"
        try:
            self.store: dist.Store | None = c10d._get_default_store()
        except Exception:  # no default store (a custom launcher): messages say less
            self.store = None
        self._process = this_process().encode()  # in every record, for the roll call
        # Who wrote each rank's records, as last read (construction reads them all): what this
        # host can still look up once the store is gone.
        self._processes: dict[int, ProcessId] = {}
        self._store_lost: str | None = None  # why the store was given up, if it was
        # This rank's record (kept here until a wait outlasts a moment) and, of the operations
        # whose collectives needed every rank, the last that ended here (the others were there).
        self._mine = Record(0, time.time(), "", None)
        self._published = True
        self._together: Record | None = None

    def _key(self, rank: int) -> str:
        return f"{self.namespace}{self.global_ranks[rank]}"

    def record(self, seq: int, what: str) -> None:
        """This rank has started operation number ``seq`` (``what``): kept here until
        :meth:`publish` ([Note: records written when waiting])."""
        self._mine = Record(seq, time.time(), what, None)
        self._published = False

    def publish(self) -> None:
        """Put this rank's record in the store, once per record: a wait has outlasted a moment,
        or this rank fails."""
        if self._published:
            return
        self._published = True
        seq, stamp, what, _ = self._mine
        # A failing store (its host died) is dropped inside _set: the collective will tell.
        self._set(self._key(self.rank), f"{seq}|{stamp:.3f}|{self._process}|{what}")

    def took_part(self) -> None:
        """A collective of the current operation that needs every rank has ended here: every
        rank of the group has reached it."""
        self._together = self._mine

    def read(self) -> dict[int, tuple[int, float, str]]:
        """Every rank's last record that exists: rank -> (sequence, unix time, what)."""
        return {rank: rec[:3] for rank, rec in self._read_all()[0].items()}

    def _read_all(self) -> tuple[dict[int, Record], Exception | None]:
        """Every rank's last record that exists, and the store's error if it failed midway
        (then the records read before it)."""
        out: dict[int, Record] = {}
        store = self.store
        if store is None:
            return out, None
        for rank in range(len(self.global_ranks)):
            key = self._key(rank)
            try:
                if not store.check([key]):
                    continue
                seq, stamp, proc, what = store.get(key).decode().split("|", 3)
                rec = Record(int(seq), float(stamp), what, ProcessId.decode(proc))
            except Exception as exc:
                return out, exc
            out[rank] = rec
            if rec.process is not None:
                self._processes[rank] = rec.process
        return out, None

    def wait_for_all(self, seq: int, timeout: timedelta) -> list[int]:
        """Wait until every rank has recorded operation ``seq``; return those that have not
        within ``timeout`` (empty: all arrived; ``[-1]``: all arrived, but some rank had given
        up before this one came). Waits in the store: no collective is involved, so a rank
        that never comes cannot hold this rank past the deadline. Every rank calls it once
        per ``seq``."""
        self.publish()
        if self.store is None:
            return []
        # A count of arrivals, and a mark set by the last to arrive: three store operations
        # each, whatever the world size (polling every rank's record cost O(N) a look).
        done = f"{self.namespace}all/{seq}"
        try:
            if self.store.add(f"{self.namespace}count/{seq}", 1) == len(self.global_ranks):
                self.store.set(done, "1")
            self.store.wait([done], timeout)
        except dist.DistNetworkError as exc:  # the store failed: the collective will tell
            self._lose_store(first_line(exc))
            return []
        except RuntimeError:  # the timeout (a FileStore's is untyped): say who is behind
            records = self.read()
            behind = [r for r in range(len(self.global_ranks)) if records.get(r, (0,))[0] < seq]
            if behind:  # tell latecomers not to go on alone
                self._set(f"{self.namespace}abandoned/{seq}", "1")
            return behind
        self._remember_processes()
        self.took_part()
        # A rank that already gave up will not take part: arriving now is too late.
        return [-1] if self._exists(f"{self.namespace}abandoned/{seq}") else []

    def _remember_processes(self) -> None:
        """Who wrote each rank's record, read in one ``multi_get`` (every rank has written
        one): what this host can still look up once the store is gone."""
        try:
            assert self.store is not None
            keys = [self._key(rank) for rank in range(len(self.global_ranks))]
            for rank, text in enumerate(self.store.multi_get(keys)):
                process = ProcessId.decode(text.decode().split("|", 3)[2])
                if process is not None:
                    self._processes[rank] = process
        except Exception as exc:  # the store failed: the collective will tell
            self._lose_store(first_line(exc))

    def _exists(self, key: str) -> bool:
        try:
            return self.store is not None and self.store.check([key])
        except Exception:
            return False

    def _set(self, key: str, value: str) -> None:
        try:
            if self.store is not None:
                self.store.set(key, value)
        except Exception as exc:
            self._lose_store(first_line(exc))

    def _lose_store(self, why: str) -> None:
        self.store, self._store_lost = None, why

    def describe_missing(self, seq: int, what: str = "") -> str:
        """Where every other rank is, seen from a rank waiting at operation ``seq`` (``what``):
        ranks behind it (and where they were last seen), ranks at another operation."""
        records, _ = self._read_all()
        return _NO_STORE if self.store is None else self._describe(records, seq, what, {})

    def after_failure(self, seq: int, what: str, seconds: float) -> str:
        """:meth:`describe_missing` after a failed collective at operation ``seq`` (``what``),
        and who is alive: a roll call of at most ``seconds`` (``liveness.py``) names the ranks
        that died and those that did not answer. Returns within ``seconds`` and a short grace
        even if the store hangs (its host gone); the store is then given up, and the text
        says so."""
        found: list[str] = []

        def diagnose() -> None:
            try:
                found.append(self._diagnose(seq, what, seconds))
            except Exception as exc:  # a bug here must not hide the failure being reported
                found.append(f"(the arrival records could not be read: {exc!r})")

        thread = threading.Thread(target=diagnose, name="gradsync-roll-call", daemon=True)
        thread.start()
        thread.join(seconds + _STORE_GRACE_S)
        if found:
            return found[0]
        # A call is stuck in the store: later records must not queue behind it.
        self._lose_store(f"it did not answer within {seconds + _STORE_GRACE_S:.1f} s")
        return self._without_store(0.0)

    def _diagnose(self, seq: int, what: str, seconds: float) -> str:
        records, error = self._read_all()
        if error is not None:
            self._lose_store(first_line(error))
        if self.store is None:
            return self._without_store(seconds)
        floor = 0 if self._together is None else self._together.seq
        others: dict[int, tuple[str, ProcessId | None]] = {}
        for rank in range(len(self.global_ranks)):
            rec = records.get(rank)
            if rank != self.rank:  # it answers at the operation it fails at: its record's if it
                # wrote one there (it waited), else this one (a survivor writes it as it fails)
                at = seq if rec is None or rec.seq <= floor else rec.seq
                others[rank] = (self._answer_key(rank, at), None if rec is None else rec.process)
        try:
            fates = roll_call(self.store, self._answer_key(self.rank, seq), others, seconds)
        except Exception as exc:
            self._lose_store(first_line(exc))
            return self._without_store(seconds)
        later, _ = self._read_all()  # the records the others wrote as they failed
        return self._describe({**records, **later}, seq, what, fates)

    def _without_store(self, seconds: float) -> str:
        """What can be said once the store is gone: which ranks' processes (as last read) this
        host sees gone. Without torchrun the store is served by rank 0's process, so a dead
        rank 0 takes the store along: then this names it."""
        if self._store_lost is None:
            return _NO_STORE
        lost = (
            f"the c10d store failed ({self._store_lost}; the host or process serving it may be "
            "down)"
        )
        known = {r: p for r, p in dict(self._processes).items() if r != self.rank}
        # Without a roll call a rank that failed too and then exited looks the same as one that
        # died first: the words say what is seen, no more.
        gone = [f"rank {r} is gone (its {known[r]} has exited)" for r in find_dead(known, seconds)]
        return "; ".join([lost, *gone]) if gone else f"{lost}, so no rank can be named"

    def _answer_key(self, rank: int, seq: int) -> str:
        """Where ``rank`` answers the roll call after failing at its operation ``seq``: a
        deadline fails once, at its current operation, which is its record's."""
        return f"{self.namespace}alive/{seq}/{self.global_ranks[rank]}"

    def _describe(
        self, records: Mapping[int, Record], seq: int, what: str, fates: Mapping[int, Fate]
    ) -> str:
        now, floor = time.time(), self._together
        lines, inside = [], []
        for rank in range(len(self.global_ranks)):
            rec, fate = records.get(rank), fates.get(rank)
            if rank == self.rank:
                continue
            if rec is not None and floor is not None and rec.seq < floor.seq:  # it was there
                rec = floor._replace(process=rec.process)
            if rec is None:
                lines.append(f"rank {rank}: never seen by gradsync")
            elif rec.seq < seq or (rec.seq == seq and what and rec.what != what):
                when = f"{now - rec.stamp:.1f} s ago at {rec.what}"
                lines.append(f"rank {rank}: last seen {when}{_since(fate, rec.process)}")
            elif rec.seq > seq:
                lines.append(f"rank {rank}: ahead, at {rec.what}{_since(fate, rec.process)}")
            elif fate is not None and fate is not Fate.ANSWERED:
                inside.append(_inside(rank, fate, rec.process))
        if lines:
            return "; ".join(lines + inside)
        if inside:
            return "; ".join(["every rank reached this operation", *inside])
        if fates:
            return (
                "every rank reached this operation and answered after the failure, so none "
                "died: one of them failed inside it (look for an earlier error in its log)"
            )
        return (
            "every rank reached this operation, so one of them failed or died inside it "
            "(look for an earlier error in its log)"
        )


# What the roll call found out, in words. Only SILENT can come without a process (a rank never
# seen, or a record without one): the others were looked up by it.
def _inside(rank: int, fate: Fate, proc: ProcessId | None) -> str:
    """A rank that reached the failed operation and did not answer the roll call."""
    if fate is Fate.GONE:
        return f"rank {rank} died inside it (its {proc} is gone)"
    if fate is Fate.STOPPED:
        return f"rank {rank} did not answer after the failure: its {proc} is stopped"
    if fate is Fate.RUNNING:
        return (
            f"rank {rank} did not answer after the failure, though its {proc} is running: "
            "stuck, or still waiting"
        )
    return f"rank {rank} did not answer after the failure: dead, or stuck{_on(proc)}"


def _since(fate: Fate | None, proc: ProcessId | None) -> str:
    """A rank last seen at another operation."""
    if fate is None:
        return ""
    return {
        Fate.ANSWERED: " (alive: it answered after the failure)",
        Fate.GONE: f" (then it died: its {proc} is gone)",
        Fate.STOPPED: f" (its {proc} is stopped)",
        Fate.RUNNING: f" (its {proc} is running, but did not answer after the failure)",
        Fate.SILENT: f" (it did not answer after the failure: dead, or stuck{_on(proc)})",
    }[fate]


def _on(proc: ProcessId | None) -> str:
    return "" if proc is None else f"; {proc}"
