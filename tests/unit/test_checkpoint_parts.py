"""The training checkpoint's parts that need no process group: the safe DCP reader, the
resumable sampler, the RNG states."""

from __future__ import annotations

import argparse
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gradsync import CheckpointError
from gradsync.checkpoint.dcp_safe import SafeFileSystemReader, SafeLoadPlanner
from gradsync.checkpoint.folder import CheckpointFolder, check_files, digest, read_manifest
from gradsync.checkpoint.rng import get_rng_state, set_rng_state
from gradsync.data import DistributedSampler


def test_dcp_values_load_with_weights_only(tmp_path: Path) -> None:
    dcp.save({"x": torch.ones(2), "lr": 0.5}, checkpoint_id=tmp_path / "ok", no_dist=True)
    state = {"x": torch.zeros(2), "lr": None}
    reader = SafeFileSystemReader(str(tmp_path / "ok"))
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert state["lr"] == 0.5 and torch.equal(state["x"], torch.ones(2))
    # A value only the unrestricted unpickler would build is refused.
    dcp.save({"args": argparse.Namespace(lr=1)}, checkpoint_id=tmp_path / "bad", no_dist=True)
    reader = SafeFileSystemReader(str(tmp_path / "bad"))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"args": None}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert "GLOBAL argparse.Namespace was not an allowed global" in str(info.value.failures[0])


def test_dcp_metadata_cannot_run_code(tmp_path: Path) -> None:
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.getcwd))  # any global function
    with pytest.raises(pickle.UnpicklingError, match="posix.getcwd.*refusing"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_sampler_resumes_mid_epoch_with_the_same_indices() -> None:
    data = list(range(30))
    full = DistributedSampler(data, num_replicas=3, rank=1, shuffle=True, seed=4)
    full.set_epoch(2)
    expected = list(full)
    taken = DistributedSampler(data, num_replicas=3, rank=1, shuffle=True, seed=4)
    taken.set_epoch(2)
    it = iter(taken)
    head = [next(it) for _ in range(4)]
    state = taken.state_dict()
    assert state["epoch"] == 2 and state["position"] == 4
    resumed = DistributedSampler(data, num_replicas=3, rank=1, shuffle=True, seed=4)
    resumed.load_state_dict(state)
    calls: list[int] = []
    resumed.call_on_resume(lambda: calls.append(1))
    resumed.set_epoch(2)  # the training loop's own call for the current epoch keeps the position
    assert head + list(resumed) == expected and calls == [1]
    assert list(resumed) == expected  # the next pass over the epoch is whole again
    resumed.set_epoch(3)
    assert resumed.position == 0
    other = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=4)
    with pytest.raises(CheckpointError, match="num_replicas=3, this one has num_replicas=2"):
        other.load_state_dict(state)


def test_rng_states_round_trip() -> None:
    np = pytest.importorskip("numpy")
    state = get_rng_state()
    before = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()
    buf = __import__("io").BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True), "test")  # tensors and plain values only
    after = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_folder_commits_by_rename_and_keeps_the_newest(tmp_path: Path) -> None:
    folder = CheckpointFolder(tmp_path)
    for step in (1, 2, 3, 3):  # step 3 saved again (after resuming from an older one)
        partial = folder.partial_dir(step)
        partial.mkdir()
        (partial / "data").write_bytes(b"x" * step)
        folder.commit(partial, step, 1, {"data": digest(partial / "data")})
    assert [e.step for e in folder.committed()] == [3, 2, 1]
    assert (tmp_path / "step_00000003.replaced-0").is_dir()
    folder.rotate(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    manifest = read_manifest(folder.step_dir(3))
    assert check_files(folder.step_dir(3), manifest["files"], ["data"]) == []
