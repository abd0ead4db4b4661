"""``make gpu-check``'s dry mode: the GPU check runs every group on CPU gloo ranks with tiny
models, so the script cannot rot between the times a GPU is lent (docs/gpu.md, "Checking it on
a GPU"). The report must hold every check below, each run or skipped with its reason: a check
dropped from the script, or one that stops reporting, fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

MODES = ["default", "bf16_wire", "fp16_wire", "powersgd", "torch_hook", "main_grads", "zero1",
         "check_finite", "item_mean", "side_default", "side_powersgd",
         "side_torch_hook"]  # fmt: skip
SYNCS = ["default", "timeline_off", "bf16_wire", "fp16_wire", "powersgd", "torch_hook",
         "main_grads", "zero1", "check_finite", "item_mean", "side_stream",
         "torch_ddp"]  # fmt: skip
EXPECTED = (
    [f"correctness.{m}" for m in MODES] + ["correctness.replica_device", "correctness.nccl2"]
    + [f"syncs.{s}" for s in SYNCS] + ["syncs.tail_in_flight", "syncs.nccl2"]
    + ["deadline.device_event", "deadline.nccl_missing_rank"]
    + ["overlap.default", "overlap.bf16_wire", "overlap.nccl2", "overlap.zero1_gathers"]
    + [f"speed.{how}.{what}" for how in ("eager", "compiled") for what in ("vs_torch", "timeline")]
    + ["speed.timeline_phases"]
)  # fmt: skip
NEEDS_TWO_GPUS = {"correctness.replica_device", "correctness.nccl2", "syncs.nccl2",
                  "deadline.nccl_missing_rank", "overlap.nccl2",
                  "overlap.zero1_gathers"}  # fmt: skip


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the pool's ranks get this sys.path too
    for name in [m for m in sys.modules if m == "gpu_check" or m.startswith("gpucheck")]:
        monkeypatch.delitem(sys.modules, name)
    import gpu_check

    return gpu_check


def test_dry_mode_reports_every_check(gpu_check: Any, tmp_path: Path) -> None:
    status = gpu_check.main(["--dry", "--out", str(tmp_path), "--name", "dry"])
    doc = json.loads((tmp_path / "dry.json").read_text())
    checks = {c["id"]: c for c in doc["checks"]}
    assert list(checks) == EXPECTED
    for cid in NEEDS_TWO_GPUS:
        assert checks[cid]["status"] == "skipped", checks[cid]
        assert "needs CUDA" in checks[cid]["reason"], checks[cid]
    ran = {cid: c for cid, c in checks.items() if cid not in NEEDS_TWO_GPUS}
    bad = {cid: (c["status"], c["reason"]) for cid, c in ran.items()
           if c["status"] not in ("pass", "met", "missed")}  # fmt: skip
    assert not bad, bad
    assert status == 0
    # Every bound the GPU run holds a world of one to also holds on CPU: bit for bit.
    assert checks["correctness.default"]["measured"]["world 1 vs one process"] == 0
    assert checks["overlap.default"]["measured"]["world 1"]["buckets launched"] >= 2
    md = (tmp_path / "dry.md").read_text()
    for cid in EXPECTED:
        assert f"`{cid}`" in md, cid
    assert (tmp_path / "dry-traces.tar.gz").exists()


def test_without_cuda_the_gpu_run_refuses(gpu_check: Any, capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
