"""A checkpoint folder belongs to one job ([Note: a folder belongs to one job] in owner.py).

Job A (one rank, its own process and process group) saves into a folder and keeps running.
Job B (two gloo ranks) pointed at the same folder is refused on every rank with a
``CheckpointError`` naming the folder and job A, before it writes or removes anything: A's save
and the partial folder of a save A has in flight are untouched. Once A is killed (SIGKILL, as a
preempted node's), B takes the folder at once and saves beside A's checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import Checkpointer
from gradsync.testing.spawn import spawn

JOB_A = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from gradsync.checkpoint import Checkpointer
    dist.init_process_group("gloo", rank=0, world_size=1)
    ckpt = Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2), timeout=30)
    ckpt.save(1)
    os.makedirs(os.path.join(sys.argv[1], ".step_00000002.partial"))  # a save in flight
    print("ready", flush=True)
    time.sleep(120)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job_b(rank: int, world: int, folder: str) -> dict[str, Any]:
    try:
        ckpt = Checkpointer(folder, model=torch.nn.Linear(2, 2), timeout=30)
    except Exception as exc:  # the test compares what each rank raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    ckpt.save(3)
    return {"error": None, "steps": sorted(e.step for e in ckpt.folder.committed())}


@pytest.mark.timeout(120)
def test_a_second_job_on_the_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["TORCHELASTIC_RUN_ID"] = "job-a"
    job_a = subprocess.Popen(
        [sys.executable, "-c", JOB_A, folder], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert job_a.stdout is not None and job_a.stdout.readline().strip() == "ready"
        refused = spawn(_job_b, 2, (folder,))
        for out in refused:
            error = out["error"]
            assert error and error.startswith("CheckpointError"), error
            assert folder in error and "job job-a" in error and f"pid {job_a.pid}" in error
        # Nothing of A's was touched: its checkpoint, and the save it has in flight.
        assert (Path(folder) / "step_00000001" / "manifest.json").is_file()
        assert (Path(folder) / ".step_00000002.partial").is_dir()
    finally:
        job_a.send_signal(signal.SIGKILL)
        job_a.wait()
    # A died without a word: the kernel dropped its lock, and B takes the folder at once.
    taken = spawn(_job_b, 2, (folder,))
    assert all(out["error"] is None and out["steps"] == [1, 3] for out in taken), taken
