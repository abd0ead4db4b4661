"""``gradsync verify`` end to end: the clean run passes, and every injected bug is named.

Each verify run called in this process runs its ranks on the session's pool of ranks and its
reference here; the command-line run starts its own. The factories below stand in for a
user's own setup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from gradsync.cli import main as gradsync_main
from gradsync.verify import VerifyConfig, format_report, verify
from gradsync.verify import runner as verify_runner
from gradsync.verify.builtin import GLOBAL_BATCH, STEPS_PER_EPOCH, make_batch
from gradsync.verify.diagnose import NO_SET_EPOCH, REPLICAS_DIFFER, SAME_DATA, SUM_NOT_MEAN

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_CAUSE = {
    "sum-not-mean": SUM_NOT_MEAN,
    "same-data": SAME_DATA,
    "no-broadcast": REPLICAS_DIFFER,
    "no-set-epoch": NO_SET_EPOCH,
}


def main(argv: list[str]) -> int:
    return gradsync_main(["verify", *argv])


def _rows(batch: tuple[torch.Tensor, ...]) -> Counter[tuple[int, ...]]:
    x, y = batch
    return Counter(tuple(r) for r in torch.cat([x, y], dim=1).tolist())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_builtin_shards_add_up_to_the_global_batch(world: int) -> None:
    # The factory contract, which the reference relies on: ranks' shards of step s are a
    # partition of batch (0, 1, s), across an epoch boundary too.
    for step in range(2 * STEPS_PER_EPOCH):
        shards = [make_batch(r, world, step) for r in range(world)]
        assert all(s[0].shape[0] == GLOBAL_BATCH // world for s in shards)
        assert sum((_rows(s) for s in shards), Counter()) == _rows(make_batch(0, 1, step))
    first_epoch = [_rows(make_batch(0, 1, s)) for s in range(STEPS_PER_EPOCH)]
    second_epoch = [_rows(make_batch(0, 1, s + STEPS_PER_EPOCH)) for s in range(STEPS_PER_EPOCH)]
    assert first_epoch != second_epoch  # set_epoch reshuffles


@pytest.mark.timeout(120)
def test_clean_run_passes_from_the_command_line(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "verify", "--steps", "4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: 2-rank training equals 1-process training" in proc.stdout
    assert "2-rank loss" in proc.stdout and "max|dparam|" in proc.stdout
    assert "likely cause" not in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", sorted(EXPECTED_CAUSE))
def test_injected_bug_fails_and_is_named(bug: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Default 6 steps: two epochs of the built-in's 3, so no-set-epoch crosses a boundary.
    assert main(["--inject", bug]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out, out
    assert f"likely cause [{EXPECTED_CAUSE[bug]}]" in out, out
    # The other known causes are not blamed.
    others = set(EXPECTED_CAUSE.values()) - {EXPECTED_CAUSE[bug]}
    assert not any(f"[{c}]" in out for c in others), out


def test_bad_arguments_exit_2_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "no_such_module_xyz:f"]) == 2
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["--inject", "no-set-epoch", "--steps", "3"]) == 2
    assert "cross an epoch boundary" in capsys.readouterr().err
    assert main(["--world-size", "5"]) == 2  # the built-in batch of 12 does not split 5 ways
    assert "world size 5" in capsys.readouterr().err


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad arguments must be rejected before any rank starts (and fast)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were spawned: the arguments should have been rejected first")

    monkeypatch.setattr(verify_runner, "spawn", refuse)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
        (["--lr", "0"], "argument --lr: must be a finite number > 0, got '0'"),
        (["--tolerance", "-1"], "argument --tolerance: must be a finite number >= 0, got '-1'"),
        (["--tolerance", "nan"], "argument --tolerance: must be a finite number >= 0, got 'nan'"),
        (["--steps", "0"], "argument --steps: must be a whole number >= 1, got '0'"),
        (["-n", "two"], "argument -n/--world-size: must be a whole number >= 1, got 'two'"),
    ],
)
@pytest.mark.usefixtures("no_spawn")
def test_bad_numbers_are_usage_errors(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Exit 1 means "diverged": a NaN learning rate or tolerance must not get that far.
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"gradsync verify: error: {expected}" in err, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "os:getcwd"], "--model os:getcwd: did not return a torch.nn.Module"),
        (["--model", "torch.nn:Identity"], "(got Identity without parameters)"),
        (
            ["--batches", "os:getcwd"],
            "--batches os:getcwd: failed in batch_fn(0, 2, 0): TypeError: ",
        ),
        (
            ["--loss", "os:getcwd"],
            "--loss os:getcwd: failed in loss_fn(model, batch_fn(0, 1, 0)): TypeError: ",
        ),
        # The default loss on a model that does not take the built-in token batches.
        (["--model", "test_verify:make_mlp"], "--loss not given: the default (cross-entropy"),
    ],
)
@pytest.mark.usefixtures("no_spawn")
def test_factories_that_fail_or_return_the_wrong_kind_exit_2_naming_the_option(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradsync verify: error: ") and expected in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


# -- a user's own setup: an MLP classifier on a fixed dataset -----------------------------------
FEATURES, CLASSES, SAMPLES, USER_GLOBAL_BATCH = 8, 5, 36, 12  # 3 steps per epoch


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def make_classification_batch(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(123)
    data = TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g),
        torch.randint(0, CLASSES, (SAMPLES,), generator=g),
    )
    per_rank, steps_per_epoch = USER_GLOBAL_BATCH // world_size, SAMPLES // USER_GLOBAL_BATCH
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=True, seed=0
    )
    sampler.set_epoch(step // steps_per_epoch)
    b = step % steps_per_epoch
    idx = list(sampler)[b * per_rank : (b + 1) * per_rank]
    return data.tensors[0][idx], data.tensors[1][idx]


@pytest.mark.timeout(120)
def test_user_factories_on_3_ranks_with_adamw_and_the_default_loss() -> None:
    # World size 3 catches off-by-one sharding; AdamW amplifies fp32 rounding of near-zero
    # gradients the most (observed ~1e-6 here), still well within the default 1e-4.
    report = verify(
        VerifyConfig(
            model=make_mlp,
            batches=make_classification_batch,
            world_size=3,
            steps=5,
            steps_per_epoch=3,
            optimizer="adamw",
        )
    )
    assert report.passed, format_report(report)
    assert report.evidence.rank_init_checksums == [report.evidence.ref_init_checksum] * 3


@pytest.mark.timeout(180)
def test_mesh_layout_passes(capsys: pytest.CaptureFixture[str]) -> None:
    # The command line end to end; every layout's equivalence is in tests/dist/test_mesh.py.
    assert main(["-n", "2", "--tp", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp1 x cp1 x tp2 = 2 ranks vs 1 process" in out and "PASS" in out, out


def test_mesh_layout_mistakes_exit_2_and_a_difference_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gradsync.testing.mesh_run import Layout
    from gradsync.verify.mesh import MeshReport

    assert main(["-n", "4", "--tp", "3"]) == 2
    assert "not divisible by cp * tp = 3" in capsys.readouterr().err
    assert main(["-n", "3", "--tp", "3"]) == 2  # the built-in GPT has 2 heads
    assert "2 attention heads" in capsys.readouterr().err
    assert main(["-n", "2", "--tp", "2", "--inject", "no-set-epoch"]) == 2
    assert "drop --inject" in capsys.readouterr().err
    report = MeshReport(Layout(dp=1, tp=2), 1, "sgd", 0.1, "mean", 25.0, tolerance=1e-4)
    report.rows = [(0, 1.0, 1.0, 1e-8, 1e-8)]
    assert report.passed
    report.rows.append((1, 1.0, 1.0, 1e-8, 2e-4))  # one gradient past the tolerance
    assert not report.passed
