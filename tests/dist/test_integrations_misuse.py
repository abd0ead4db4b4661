"""A launch of several processes that HF Accelerate leaves undistributed is refused on every rank.

Under ``torchrun --nproc-per-node 2`` on a machine without GPUs, an ``Accelerator`` without
``cpu=True`` (a Trainer without ``TrainingArguments(use_cpu=True)``) ends with
``distributed_type`` NO and one process, without a word: every rank would train its own model.
gradsync's integration raises ``UsageError`` instead, naming the setting. The ranks run as in
``test_integrations.py`` (fresh processes with torchrun's variables, a gloo group already joined),
on whatever machine runs the tests: with a GPU per rank Accelerate would distribute over the GPUs,
so the test hides them.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from test_integrations import WORLD, _framework_env, _free_port

from gradsync.testing.spawn import spawn


def _error(make: Any) -> str:
    """The text of the ``UsageError`` that ``make()`` raises, or a line saying it raised none."""
    from gradsync.errors import UsageError

    try:
        made = make()
    except UsageError as exc:
        return str(exc)
    return f"no error: {made!r}"


def _undistributed_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    """Each integration without the CPU setting (refused), then with it (distributed)."""
    _framework_env(rank, world, port)
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from gradsync.integrations.accelerate import GradsyncAccelerator, GradsyncTrainer

    def trainer(use_cpu: bool) -> Any:
        # TrainingArguments sets Accelerate's process-wide state up afresh, from use_cpu.
        args = TrainingArguments(output_dir=out_dir, use_cpu=use_cpu, report_to="none")
        return GradsyncTrainer(model=torch.nn.Linear(2, 1), args=args).accelerator

    out: dict[str, Any] = {"accelerator": _error(GradsyncAccelerator)}
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's own reset
    out["accelerator cpu=True"] = GradsyncAccelerator(cpu=True).num_processes
    with tempfile.TemporaryDirectory(prefix=f"gradsync-undistributed-{rank}-") as out_dir:
        out["trainer"] = _error(lambda: trainer(use_cpu=False))
        fixed = trainer(use_cpu=True)
        out["trainer use_cpu=True"] = (type(fixed).__name__, fixed.num_processes)
    return out


def test_a_launch_that_accelerate_leaves_undistributed_is_refused_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    # No GPU for Accelerate to find, as on a CPU machine: set before the ranks start, since torch
    # reads it once per process.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    per_rank = spawn(_undistributed_rank, WORLD, (_free_port(),), timeout_s=240, fresh=True)
    launched = f"gradsync: launched as {WORLD} processes (WORLD_SIZE={WORLD}), "
    for rank, out in enumerate(per_rank):
        for run, fix in (("accelerator", "cpu=True"), ("trainer", "use_cpu=True")):
            message, where = out[run], f"{run}, rank {rank}"
            assert message.startswith(launched), (where, message)
            assert "(distributed_type NO, num_processes 1)" in message, (where, message)
            assert f"pass {fix} to" in message, (where, message)
            assert "ACCELERATE_USE_CPU=true" in message, (where, message)
        # The fixes the messages name do distribute: no refusal, both processes in the run.
        assert out["accelerator cpu=True"] == WORLD, (rank, out)
        assert out["trainer use_cpu=True"] == ("GradsyncAccelerator", WORLD), (rank, out)
