"""kill -9 of a random rank under ``torchrun --max-restarts 1``: the job restarts by itself,
resumes from its newest complete checkpoint and ends bit-identical to a run that never stopped.

The job (``scripts/resume_job.py``) trains with dropout, shuffling, an LR schedule and gradient
accumulation, saving every 2 of its 8 steps. One rank SIGKILLs itself in the middle of step 5
(the newest checkpoint is step 4), or halfway through writing its part of checkpoint 6 (which
then never commits, so the newest complete one is again step 4).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gradsync.checkpoint import load_checkpoint
from gradsync.testing.spawn import spawn

SCRIPT = Path(__file__).parent / "scripts" / "resume_job.py"


def run_job(world: int, folder: Path, *extra: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--max-restarts", "1", "--monitor-interval", "0.2",
        str(SCRIPT), str(folder), *extra,
    ]  # fmt: skip
    # torch 2.13's torchrun shares one store across attempts unless told not to (see
    # gradsync/elastic.py); the README's restart command sets the same variable.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], Path]]:
    """The same job with no fault, per world size, run once for the module: on the pool's
    ranks, which share one start-up (the faulty runs are the ones that need torchrun)."""
    runs: dict[int, Path] = {}
    sys.path.insert(0, str(SCRIPT.parent))  # the pool's ranks get this sys.path too
    try:
        import resume_job

        def get(world: int) -> Path:
            if world not in runs:
                runs[world] = tmp_path_factory.mktemp(f"uninterrupted-{world}")
                spawn(resume_job.uninterrupted, world, (str(runs[world]),))
            return runs[world]

        yield get
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop("resume_job", None)


def differences(a: dict, b: dict) -> list[str]:
    """Every model tensor, optimizer tensor and RNG state that is not torch.equal."""
    out = [f"model {k}" for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    for i, state in a["optimizer"]["state"].items():
        for k, v in state.items():
            if not torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][i][k])):
                out.append(f"optimizer state {i} {k}")
    if a["optimizer"]["param_groups"] != b["optimizer"]["param_groups"]:
        out.append("optimizer param_groups (LR schedule)")
    if not torch.equal(a["rng"], b["rng"]):
        out.append("rng")
    return out


@pytest.mark.timeout(400)
# Each fault and each world size once (not every pair: the suite's time is budgeted).
@pytest.mark.parametrize(("world", "fault"), [(2, "step"), (3, "save")])
def test_kill_9_of_a_random_rank_resumes_bit_identical(
    world: int, fault: str, tmp_path: Path, uninterrupted
) -> None:
    rank = random.randrange(world)
    kill_at = "5" if fault == "step" else "6"
    out = run_job(world, tmp_path, "--kill", fault, "--kill-rank", str(rank), "--kill-at", kill_at)
    where = f"(rank {rank} killed {'mid-step 5' if fault == 'step' else 'writing checkpoint 6'})"
    assert "exitcode: -9" in out, where + out  # torchrun saw the SIGKILL ...
    for r in range(world):  # ... and every rank of the second attempt resumed from step 4
        assert f"RANK {r} ATTEMPT 1 FROM 4" in out, where + out
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000008"]
    assert not list(tmp_path.glob(".step_*")), where  # the killed save's partial folder is gone
    reference = uninterrupted(world)
    for r in range(world):
        a = load_checkpoint(reference / f"final-{r}.pt")
        b = load_checkpoint(tmp_path / f"final-{r}.pt")
        assert differences(a, b) == [], f"rank {r} {where}"
