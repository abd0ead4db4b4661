"""Jobs racing for one checkpoint folder: exactly one wins, however their starts interleave.

[Note: a folder belongs to one job] in owner.py. Every job here stays alive until the test has
seen every outcome, so the jobs' lives overlap and a second winner is always a bug, even where
the first dropped its ``Checkpointer`` before the second started (a job goes on after its last
save, and a restart of it would resume from the folder). The jobs are separate ``spawn`` runs
started from threads, each with its own process group; they meet through files.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import Checkpointer, owner
from gradsync.errors import CheckpointError
from gradsync.testing.spawn import spawn

RACERS, FOLDERS = 3, 12


def _meet(place: Path, name: str, me: str, count: int) -> None:
    """Leave ``name`` + ``me`` in ``place``; wait until ``count`` of ``name`` are there."""
    (place / f"{name}.{me}").touch()
    give_up = time.monotonic() + 60
    while len(list(place.glob(f"{name}.*"))) < count:
        assert time.monotonic() < give_up, f"only some jobs reached {name}"
        time.sleep(0.005)


def _racer(rank: int, world: int, me: int, folders: list[str], place: Path) -> dict[int, Any]:
    """A one-rank job going through every folder in its own order with its own pauses, saving
    its number + 1 as the step (a folder's steps say who wrote there). Half the time the
    winner drops its checkpointer at once."""
    os.environ["TORCHELASTIC_RUN_ID"] = f"racer-{me}"
    rng, model, kept = random.Random(me), torch.nn.Linear(2, 2), []
    seen: dict[int, str | None] = {}
    _meet(place, "ready", str(me), RACERS)
    for i in rng.sample(range(len(folders)), len(folders)):
        time.sleep(rng.random() * 0.03)
        try:
            ckpt = Checkpointer(folders[i], model=model, timeout=30)
        except CheckpointError as exc:
            seen[i] = str(exc)
            continue
        ckpt.save(me + 1)
        seen[i] = None
        if rng.random() < 0.5:
            kept.append(ckpt)
        del ckpt
        gc.collect()
    _meet(place, "done", str(me), RACERS)  # alive until every racer has been everywhere
    return seen


def _steps(folder: str) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in Path(folder).glob("step_*"))


def _in_threads(runs: list[tuple[Any, ...]], fn: Any, world: int) -> list[Any]:
    """``spawn`` each of ``runs`` at once: the first on the pool, the others fresh."""
    with ThreadPoolExecutor(len(runs)) as ex:
        futures = [
            ex.submit(spawn, fn, world, args, fresh=i > 0, return_failures=True)
            for i, args in enumerate(runs)
        ]
        return [f.result() for f in futures]


@pytest.mark.timeout(180)
def test_racing_one_rank_jobs_leave_each_folder_one_winner(tmp_path: Path) -> None:
    folders = [str(tmp_path / f"ckpt{i}") for i in range(FOLDERS)]
    runs = _in_threads([(me, folders, tmp_path) for me in range(RACERS)], _racer, 1)
    seen = [run[0] for run in runs]
    for i, folder in enumerate(folders):
        winners = [me for me in range(RACERS) if seen[me][i] is None]
        assert len(winners) == 1, (folder, winners, _steps(folder))
        assert _steps(folder) == [winners[0] + 1], folder
        for me in range(RACERS):
            refusal = seen[me][i]
            assert me in winners or f"job racer-{winners[0]}" in refusal, refusal
    # Every racer has ended: their claims ended with them, and a new job takes each folder.
    for folder in folders:
        owner.claim(Path(folder))
    owner.release_all()


def _job(rank: int, world: int, job: int, folder: str, place: Path) -> str | None:
    """A two-rank job that saves step ``job``, drops its checkpointer and lives on until told
    to end; told to, its rank 0 is killed first (a lost rank, the others going on)."""
    os.environ["TORCHELASTIC_RUN_ID"] = f"job-{job}"
    _meet(place, "ready", f"{job}.{rank}", 4)  # the four ranks claim at the same moment
    try:
        ckpt = Checkpointer(folder, model=torch.nn.Linear(2, 2), timeout=30)
        ckpt.save(job)
        del ckpt
        said = None
    except CheckpointError as exc:
        said = str(exc)
    (place / f"tmp.{job}.{rank}").write_text(json.dumps([os.getpid(), said]))
    (place / f"tmp.{job}.{rank}").rename(place / f"said.{job}.{rank}")  # read whole or not at all
    while not (place / "end").exists():
        if rank == 0 and (place / f"kill.{job}").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)
    return said


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except OSError:
        return True


def _judge_and_kill(folder: str, place: Path) -> None:
    try:
        _judge(folder, place)
    finally:
        (place / "end").touch()


def _judge(folder: str, place: Path) -> None:
    said: dict[str, Any] = {}
    give_up = time.monotonic() + 120
    while len(said) < 4:
        assert time.monotonic() < give_up, said
        said = {p.name[5:]: json.loads(p.read_text()) for p in place.glob("said.*")}
        time.sleep(0.01)
    winners = [job for job in (1, 2) if said[f"{job}.0"][1] is None is said[f"{job}.1"][1]]
    assert len(winners) == 1, said
    winner, loser = winners[0], 3 - winners[0]
    for rank in (0, 1):
        error = said[f"{loser}.{rank}"][1]
        assert error.startswith("gradsync: the checkpoint folder") and folder in error
        assert f"job job-{winner}" in error, error
    assert _steps(folder) == [winner]
    # The winner's rank 0 is lost; its rank 1 lives on (and would regroup): still its folder.
    (place / f"kill.{winner}").touch()
    while not _gone(said[f"{winner}.0"][0]):
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match=f"job job-{winner}"):
        owner.claim(Path(folder))


@pytest.mark.timeout(180)
def test_two_jobs_started_together_one_wins_and_keeps_it_past_its_rank_0(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    with ThreadPoolExecutor(1) as ex:
        judged = ex.submit(_judge_and_kill, folder, tmp_path)
        runs = _in_threads([(job, folder, tmp_path) for job in (1, 2)], _job, 2)
        judged.result()
    assert sum(1 for run in runs for out in run if not isinstance(out, str | None)) == 1
    owner.claim(Path(folder))  # both jobs have ended: the folder is free
    owner.release_all()
