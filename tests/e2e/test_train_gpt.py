"""The main job, launched exactly as users launch it: torchrun, 2 ranks, gloo on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_train_gpt_matches_single_process(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--max-steps", "12", "--out", str(tmp_path / "run"), "--timeout-s", "60",
        "--save-every", "6", "--eval-sequences", "64", "--timeline", str(tmp_path / "tl.png"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "PASS" in out and "float64" in out, out
    assert "(cap 25 MiB)" in out, out  # two ranks on one host: the default is torch's cap
    # The step timeline: reports from step 2 on (one step behind), and its plot.
    assert "step timeline, last 10 steps: median step" in out, out
    assert (tmp_path / "tl.png").stat().st_size > 10_000
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 12
    assert "tok_emb.weight" in state["model"]  # keys of the unwrapped model, no "module."
    assert not any(k.startswith("module.") for k in state["model"])
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == [".gradsync-owner", "step_00000006", "step_00000012"], saved


@pytest.mark.timeout(60)
def test_the_timeline_plot_needs_matplotlib_and_says_so_before_training(tmp_path: Path) -> None:
    # `python examples/train_gpt.py` puts examples/ first on sys.path (for gpt_setup.py);
    # runpy.run_path does not, so the code does.
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "  # as if it were not installed
        f"sys.path.insert(0, {str(ROOT / 'examples')!r}); "
        f"sys.argv = ['train_gpt.py', '--timeline', {str(tmp_path / 'tl.png')!r}]; "
        f"runpy.run_path({str(ROOT / 'examples' / 'train_gpt.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'gradsync[bench]'" in proc.stderr
    assert "gradsync:" not in proc.stdout  # stopped before any training


@pytest.mark.timeout(120)
def test_train_gpt_reports_a_wrong_tolerance_as_fail(tmp_path: Path) -> None:
    # The check can fail: with an impossible tolerance the job exits non-zero with FAIL.
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_gpt.py"),
        "--max-steps", "2", "--out", str(tmp_path / "run"), "--tolerance", "-1",
        "--eval-sequences", "64",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout


@pytest.mark.timeout(120)
def test_train_gpt_lossy_wire_compares_final_losses(tmp_path: Path) -> None:
    # A lossy wire cannot match 1 process to 1e-7: the job prints the parameter difference and
    # both final losses, and checks that the loss exceeds the exact one by at most the
    # format's tolerance (PowerSGD: 2%).
    # One run (~20 s), of the format furthest from exact. 12 steps, not fewer: in the first
    # steps the loss falls so fast that PowerSGD's lag is large relative to it (8% after 6
    # steps, 0.26% after 12; the full run's figure is in benchmarks/2026-11-22-wire.md).
    # Both final losses on the same 128 sequences, not the job's 512: -0.49% against -0.52%,
    # 11 s less of the e2e stream.
    compression = "powersgd"
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train_gpt.py"), "--max-steps", "12", "--save-every", "0",
        "--out", str(tmp_path / "run"), "--timeout-s", "60", "--compression", compression,
        "--eval-sequences", "128",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"({compression} wire, not exact; must be <= 0.02): PASS" in out, out
    assert "max |param(N=2 ranks) - param(1 process)|" in out and "final loss" in out, out


@pytest.mark.timeout(240)
def test_train_3d_matches_single_process(tmp_path: Path) -> None:
    # 4 ranks, dp1 x cp2 x tp2: the 8-rank layout of `make train-3d` runs in tests/dist.
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(ROOT / "examples" / "train_3d.py"), "--cp", "2", "--tp", "2", "--steps", "3",
        "--timeout-s", "60",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "dp1 x cp2 x tp2" in out and "PASS" in out, out


@pytest.mark.timeout(240)
def test_train_gpt_continues_on_fewer_ranks_and_still_matches(tmp_path: Path) -> None:
    """`make train-resize` in small: 3 ranks stop at step 4 as if a node were lost, 2 resume
    (32 sequences a step: 11/11/10, then 16/16) and end equal to one process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    common = [
        str(ROOT / "examples" / "train_gpt.py"), "--global-batches", "--max-steps", "8",
        "--out", str(tmp_path / "run"), "--timeout-s", "60", "--save-every", "4",
        "--eval-sequences", "64", "--sentences", "800",
    ]  # fmt: skip
    outputs = []
    for world, extra in (("3", ["--stop-at", "4"]), ("2", [])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", world, *common, *extra]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
        outputs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, outputs[-1]
    assert "stopped at step 4 on 3 rank(s)" in outputs[0], outputs[0]
    assert "the world size changed from 3 to 2 at step 4" in outputs[1], outputs[1]
    assert "resumed at step 4" in outputs[1] and "PASS" in outputs[1], outputs[1]
