"""``gradsync bench`` end to end on loopback, with a tiny model and one round: it runs, shows
progress, and writes a report with every variant, the JSON and both plots.

Loopback only (``--where loopback``): no root needed, and the cluster path is covered by
``test_multinode.py``. The numbers of a one-round run mean nothing; only their presence is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(90)
def test_bench_cli_on_loopback_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "gradsync", "bench", "--where", "loopback", "--out", str(out),
        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--rounds", "1", "--warmup", "0", "--caps", "0", "25", "none",
        "--busbw-sizes-mib", "1", "--busbw-iters", "1", "--busbw-warmup", "0", "--formats",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), MPLBACKEND="Agg")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loopback, 2 ranks" in proc.stderr  # the progress bar
    text = (out / "report.md").read_text()
    for name in [
        "average_gradients",
        "gradsync cap 0 MB (per parameter)",
        "gradsync default",
        "gradsync scaled",
        "gradsync cap 25 MB",
        "gradsync one bucket",
        "gradsync bucket_cap_mb='auto'",
        "torch DDP default",
        "gradsync bf16 wire",
        "gradsync PowerSGD rank 4",
        "torch DDP + bf16_compress_hook",
        "torch DDP + PowerSGD hook rank 4 (1 bucket)",
        "compute only (local)",
        "flat (all gradient bytes, 1 call)",
    ]:
        assert f"| {name} |" in text or f"| comm only: {name} |" in text, text
    assert "gradsync default step <= 1.0x torch DDP default" in text
    # Each bf16 wire at its library's default cap, then both at the same cap.
    assert "gradsync bf16 step < torch DDP + bf16_compress_hook (default caps)" in text
    assert "gradsync bf16 step < torch DDP + bf16_compress_hook (cap 5 MB)" in text
    (result,) = json.loads((out / "results.json").read_text())
    assert result["world"] == 2 and result["setting"] == "loopback"
    assert all(len(t) == 1 for t in result["step_s"].values())
    # One parameter per bucket with cap 0: as many all-reduces as trainable parameters.
    per_param = result["comm_bytes"]["gradsync cap 0 MB (per parameter)"]
    assert len(per_param) == len(result["comm_bytes"]["average_gradients"])
    assert len(result["comm_bytes"]["gradsync one bucket"]) == 1
    # Two ranks on one host: the default is torch's 25 MiB, the plan of the 25 MB row.
    assert result["default_plan"].startswith("cap 25 MB:"), result["default_plan"]
    assert result["comm_bytes"]["gradsync default"] == result["comm_bytes"]["gradsync cap 25 MB"]
    # --formats: bytes per step for each wire format. bf16 sends half of fp32's gradient bytes,
    # plus gradsync's exact flags and tags (a few elements per parameter: within 10%).
    sent = result["step_bytes"]
    fp32 = sent["torch DDP default"]
    assert 0.45 * fp32 <= sent["gradsync bf16 wire"] <= 0.55 * fp32, sent
    assert sent["torch DDP + bf16_compress_hook"] == fp32 // 2, sent
    # This 32-wide model's matrices gain little from rank 4, but PowerSGD must send less.
    assert sent["gradsync PowerSGD rank 4"] < 0.5 * fp32, sent
    assert "### wire formats: loopback, 2 ranks" in text
    assert "gradsync PowerSGD rank 4 sends >= 20x fewer bytes than fp32" in text
    for png in ["step_vs_bucket.png", "breakdown.png"]:
        assert (out / png).stat().st_size > 1000


@pytest.mark.timeout(90)
def test_bench_host_bound_runs_and_writes_the_targets(tmp_path: Path) -> None:
    # One world size of two ranks (world size 1 runs in-process in test_bench_report.py).
    out = tmp_path / "host"
    flags = "--worlds 2 --host-layers 4 --rounds 2 --warmup 0 --steps-per-round 2".split()
    cmd = [sys.executable, "-m", "gradsync", "bench", "--where", "host", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=80, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "host-bound, 2 ranks" in proc.stderr  # the progress bar
    text = (out / "report.md").read_text()
    assert "## host-bound, 2 ranks" in text, text
    assert "- host-bound, 2 ranks: gradsync default step <= 1.00x torch DDP default" in text
    assert "- host-bound, 2 ranks: the step timeline <= 1.01x of gradsync's step" in text
    (result,) = json.loads((out / "results.json").read_text())
    assert result["world"] == 2 and result["num_tensors"] == 8
    assert all(len(t) == 2 for t in result["step_s"].values())
