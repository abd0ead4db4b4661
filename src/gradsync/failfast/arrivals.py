"""Where each rank was last seen: arrival records in the process group's key-value store.

A collective that times out only tells the waiting rank that *someone* did not come; gloo's
message names no rank ("Connection closed by peer", or a timeout). So that every survivor can
say *which* rank is missing and where it was last seen, each rank writes one small record to
the c10d store (the rendezvous store every process group already has) when it starts one of
gradsync's operations: ``"<sequence>|<unix time>|<what>"``, under a key per global rank. The
sequence number counts gradsync's operations on the group, which every rank runs in the same
order, so a rank whose record is behind the reader's never arrived. This follows torch's flight
recorder for NCCL, which keeps per-rank collective records for the same purpose.

Cost: one store write per synchronised step (a round trip to the store: tens of microseconds on
one host), never a collective. Reads happen only on the error path, and only for keys that
exist (``check`` first), so a rank that never wrote cannot make the reader block.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_PREFIX = "gradsync/last_seen/"


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

    def _key(self, rank: int) -> str:
        return f"{self.namespace}{self.global_ranks[rank]}"

    def record(self, seq: int, what: str) -> None:
        """Say that this rank has started operation number ``seq`` (``what``)."""
        # A failing store (its host died) is dropped inside _set: the collective will tell.
        self._set(self._key(self.rank), f"{seq}|{time.time():.3f}|{what}")

    def read(self) -> dict[int, tuple[int, float, str]]:
        """Every rank's last record that exists: rank -> (sequence, unix time, what)."""
        out: dict[int, tuple[int, float, str]] = {}
        if self.store is None:
            return out
        for rank in range(len(self.global_ranks)):
            key = self._key(rank)
            try:
                if not self.store.check([key]):
                    continue
                seq, stamp, what = self.store.get(key).decode().split("|", 2)
                out[rank] = (int(seq), float(stamp), what)
            except Exception:
                break  # the store is unreachable: report what was read
        return out

    def wait_for_all(self, seq: int, timeout: timedelta) -> list[int]:
        """Wait until every rank has recorded operation ``seq``; return those that have not
        within ``timeout`` (empty: all arrived; ``[-1]``: all arrived, but some rank had given
        up before this one came). Polls the store: no collective is involved, so a rank that
        never comes cannot hold this rank past the deadline."""
        if self.store is None:
            return []
        give_up = time.monotonic() + timeout.total_seconds()
        pause = 0.001
        abandoned = f"{self.namespace}abandoned/{seq}"
        while True:
            records = self.read()
            behind = [r for r in range(len(self.global_ranks)) if records.get(r, (0,))[0] < seq]
            if not behind:
                # A rank that already gave up will not take part: arriving now is too late.
                return [-1] if self._exists(abandoned) else []
            if time.monotonic() >= give_up:
                self._set(abandoned, "1")  # tell latecomers not to go on alone
                return behind
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _exists(self, key: str) -> bool:
        try:
            return self.store is not None and self.store.check([key])
        except Exception:
            return False

    def _set(self, key: str, value: str) -> None:
        try:
            if self.store is not None:
                self.store.set(key, value)
        except Exception:
            self.store = None

    def describe_missing(self, seq: int, what: str = "") -> str:
        """Where every other rank is, seen from a rank waiting at operation ``seq`` (``what``):
        ranks behind it (and where they were last seen), ranks at another operation."""
        records = self.read()
        if self.store is None:
            return "(no arrival records: this job has no c10d store)"
        now = time.time()
        lines = []
        for rank in range(len(self.global_ranks)):
            rec = records.get(rank)
            if rank == self.rank:
                continue
            if rec is None:
                lines.append(f"rank {rank}: never seen by gradsync")
            elif rec[0] < seq or (rec[0] == seq and what and rec[2] != what):
                lines.append(f"rank {rank}: last seen {now - rec[1]:.1f} s ago at {rec[2]}")
            elif rec[0] > seq:
                lines.append(f"rank {rank}: ahead, at {rec[2]}")
        if not lines:
            return (
                "every rank reached this operation, so one of them failed or died inside it "
                "(look for an earlier error in its log)"
            )
        return "; ".join(lines)
