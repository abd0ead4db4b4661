"""Membership changes and the messages behind them are typed records: the dicts users read from
``Recovery.events`` (and ``result.json``) and the lines rank 0 logs are the ones they were when
the records were dicts, and the messages that travel through the store come back as they went."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch.distributed as dist

from gradsync.recovery import (
    Admitted,
    Joined,
    Lost,
    NoRecoveryError,
    RankExcludedError,
    Report,
    heal,
)
from gradsync.recovery.events import log_admitted, log_fallback, log_lost

LOST = Lost(2, (1, 3), 7, ("backward", "forward"), 2, 0, 100.0, 100.25, 100.5, "E: boom")


def test_a_loss_reads_as_the_dict_it_was_with_redone_s_once_redone() -> None:
    keys = "generation lost step phases world_size rank noticed agreed regrouped error".split()
    assert list(LOST.as_dict()) == keys  # not redone yet: no redone_s, as before
    done = LOST.as_dict() | {"redone_s": 0.125}
    assert replace(LOST, redone_s=0.125).as_dict() == done
    assert done["lost"] == [1, 3] and done["phases"] == ["backward", "forward"]
    assert json.loads(json.dumps(done)) == done  # lists, not tuples: JSON-ready as it was


def test_joins_and_admissions_read_as_the_dicts_they_were() -> None:
    joined = Joined(3, (4, 5), 20, world_size=4, rank=3, asked=1.0, admitted=2.0, switched=3.0)
    assert joined.as_dict() == dict(
        generation=3,
        joined=[4, 5],
        step=20,
        world_size=4,
        rank=3,
        asked=1.0,
        admitted=2.0,
        switched=3.0,
    )
    admitted = Admitted(3, (4,), 20, 3, 1, started=1.0, asked=None, regrouped=2.0, switched=3.0)
    keys = "generation joined step world_size rank started asked regrouped switched".split()
    assert list(admitted.as_dict()) == keys
    assert admitted.as_dict()["asked"] is None and admitted.as_dict()["joined"] == [4]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gradsync.recovery"]


def test_rank_0_logs_the_lines_it_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gradsync.recovery")
    log_lost(replace(LOST, redone_s=0.25))
    log_lost(replace(LOST, lost=(), redone_s=0.25))
    log_lost(replace(LOST, rank=1, redone_s=0.25))  # other ranks say nothing
    log_admitted(Admitted(3, (4, 5), 20, 4, 0, 1.0, 0.5, 1.5, 1.125))
    log_admitted(Admitted(3, (4, 5), 20, 4, 2, 1.0, None, 1.5, 1.125))
    assert _lines(caplog) == [
        "gradsync: rank 1, 3 lost at step 7 (noticed in backward/forward); continuing on 2 "
        "ranks, step 7 redone in 0.75 s",
        "gradsync: no rank lost, though a collective failed (E: boom) at step 7 (noticed in "
        "backward/forward); continuing on 2 ranks, step 7 redone in 0.75 s",
        "gradsync: 2 rank(s) joined at step 20; continuing on 4 ranks (switched in 0.12 s)",
    ]


def test_a_rank_that_cannot_recover_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "gradsync.recovery")
    log_fallback(2, 9, NoRecoveryError("lost rank(s) [0] but cannot go on: no store"))
    log_fallback(2, 9, RankExcludedError("rank 2 of generation 0 answered after the others"))
    assert _lines(caplog) == [
        "gradsync: rank 2 cannot recover in-process at step 9 (gradsync: lost rank(s) [0] but "
        "cannot go on: no store); exiting so that the job restarts from its last checkpoint",
        "gradsync: rank 2 of generation 0 answered after the others (step 9)",
    ]


def test_what_travels_through_the_store_comes_back_as_it_went() -> None:
    assert Report.from_json(Report(5, "optimizer step").to_json()) == Report(5, "optimizer step")
    store = dist.HashStore()
    assert heal.offered(store, "job/0") is None
    heal.offer(store, "job/0", heal.Offer(30, (1, 2)))
    assert heal.offered(store, "job/0") == heal.Offer(30, (1, 2))
    admission = heal.Admission("job", 1, 3, (1, 2))
    heal.admit(store, admission)
    assert heal.waiting(store) == ()  # both admitted (no ticket was taken here)
    got = heal.wait_for_admission(store, 2, timeout=1.0)
    assert got == admission and (got.world_size, got.rank_of(1), got.rank_of(2)) == (5, 3, 4)
