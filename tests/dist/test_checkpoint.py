"""Checkpoints on real gloo ranks: the wrapper's prefix handling and the training checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from gradsync.data import DistributedSampler
from gradsync.optim import MasterWeights
from gradsync.testing.spawn import spawn


class Holder(nn.Module):
    """A user's model whose only child is called ``module``: every key starts with "module."."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 2)


def _listed(folder: Path) -> list[str]:
    """The checkpoint folder's entries, but the lock file of the job using it (owner.py)."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".gradsync-owner")


def _prefixes(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(rank)
    ddp = gradsync.DistributedDataParallel(Holder())
    path = Path(folder) / f"holder-{rank}.pt"
    save_checkpoint(ddp.state_dict(), path)
    fresh = gradsync.DistributedDataParallel(Holder())
    with torch.no_grad():
        fresh.module.module.weight.zero_()
    fresh.load_state_dict(load_checkpoint(path))  # strict: its own keys, prefix kept
    torch_ddp_style = {f"module.{k}": v for k, v in ddp.state_dict().items()}
    again = gradsync.DistributedDataParallel(Holder())
    again.load_state_dict(torch_ddp_style)  # one wrapper prefix stripped, not two
    return {
        "keys": sorted(ddp.state_dict()),
        "equal": all(
            torch.equal(a, b) and torch.equal(a, c)
            for a, b, c in zip(
                ddp.parameters(), fresh.parameters(), again.parameters(), strict=True
            )
        ),
    }


def test_a_model_with_a_child_named_module_round_trips(tmp_path: Path) -> None:
    for out in spawn(_prefixes, 2, (str(tmp_path),)):
        assert out["keys"] == ["module.bias", "module.weight"]
        assert out["equal"]


# -- the training checkpoint -------------------------------------------------------------------
class Dropper(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.drop(self.inp(x))))


class Job:
    """A tiny job with everything a resume must get right: dropout, shuffling, an LR schedule
    and two micro-batches per step (gradient accumulation)."""

    def __init__(self, rank: int, world: int, folder: str, width: int = 16, keep: int = 2):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(48, 4, generator=gen), torch.randint(0, 3, (48,), generator=gen)
        )
        self.sampler = DistributedSampler(data, world, rank, shuffle=True, seed=1, drop_last=True)
        self.loader = DataLoader(data, batch_size=4, sampler=self.sampler)
        torch.manual_seed(0)
        self.ddp = gradsync.DistributedDataParallel(Dropper(width))
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        torch.manual_seed(100 + rank)  # each rank's dropout stream is its own
        self.ckpt = Checkpointer(
            folder, model=self.ddp, optimizer=self.opt, lr_scheduler=self.sched,
            sampler=self.sampler, keep=keep, timeout=30,
        )  # fmt: skip
        self.step = 0
        self._batches: Iterator | None = None

    def batches(self) -> Iterator:
        epoch = self.sampler.epoch
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def train(self, until: int) -> None:
        if self._batches is None:
            self._batches = self.batches()
        while self.step < until:
            for micro in range(2):
                x, y = next(self._batches)
                with self.ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    (F.cross_entropy(self.ddp(x), y) / 2).backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.step += 1

    def resume(self) -> int | None:
        step = self.ckpt.load()
        self.step = step or 0
        return step

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer tensor, and the RNG state: what must be equal."""
        out = {f"param {k}": v.detach().clone() for k, v in self.ddp.state_dict().items()}
        for i, s in self.opt.state_dict()["state"].items():
            out |= {f"opt {i} {k}": torch.as_tensor(v).clone() for k, v in s.items()}
        out["rng"] = torch.get_rng_state()
        out["lr"] = torch.tensor(self.sched.get_last_lr())
        return out


def _all_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _resume_equals_never_stopping(rank: int, world: int, root: Path) -> dict:
    out: dict = {}
    job = Job(rank, world, str(root / "run"))
    out["fresh"] = job.resume()
    job.train(2)
    job.ckpt.async_save(2)
    job.train(4)
    job.ckpt.async_save(4)  # refills step 2's copy; training goes on while it is written
    job.train(7)
    reference = job.tensors()
    job.ckpt.save(7)
    out["kept"] = _listed(root / "run")  # keep=2: step 2 is gone
    # A new job (as after a restart) resumes from the newest checkpoint and finishes the same.
    again = Job(rank, world, str(root / "run"))
    out["resumed_at"] = again.ckpt.load(root / "run" / "step_00000004")
    again.step = 4
    again.train(7)
    out["differ"] = _all_equal(again.tensors(), reference)
    out["step_counter"] = again.ddp.reducer.num_reductions
    return out


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the test compares what every rank raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _on_rank0(rank: int, change: Callable[[], Any]) -> None:
    if rank == 0:
        change()
    dist.barrier()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[len(data) // 2 + 1] ^= 0x10
    path.write_bytes(data)


def _load_warned(job: Job) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = job.ckpt.load()
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
    return result, [str(w.message) for w in caught]


def _corrupted_checkpoints(rank: int, world: int, root: Path) -> dict:
    out: dict = {}
    folder = root / "c"
    job = Job(rank, world, str(folder), keep=3)
    for step in (1, 2, 3):
        job.train(step)
        job.ckpt.save(step)
    s1, s2, s3 = (folder / f"step_0000000{i}" for i in (1, 2, 3))
    _on_rank0(rank, lambda: _flip(s3 / f"__{world - 1}_0.distcp"))
    out["flipped"] = _load_warned(job)
    out["flipped_path"] = _error(lambda: job.ckpt.load(s3))
    _on_rank0(rank, lambda: os.truncate(s2 / "__0_0.distcp", 100))
    out["truncated"] = _load_warned(job)
    out["truncated_path"] = _error(lambda: job.ckpt.load(s2))
    _on_rank0(rank, lambda: (s1 / "__0_0.distcp").unlink())
    out["missing"] = _load_warned(job)
    # A save killed before its commit leaves a partial folder: the next job removes it.
    _on_rank0(rank, lambda: (folder / ".step_00000004.partial").mkdir())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Job(rank, world, str(folder))
    out["partial_warned"] = [str(w.message) for w in caught]
    out["after_restart"] = _listed(folder)
    return out


def _refusals(rank: int, world: int, root: Path) -> dict:
    out: dict = {}
    job = Job(rank, world, str(root / "d"))
    job.train(1)
    job.ckpt.save(1)
    wider = Job(rank, world, str(root / "d"), width=32)
    out["other_model"] = _error(wider.ckpt.load)
    job.sched.args = argparse.Namespace(lr=1)  # type: ignore[attr-defined]
    out["unloadable"] = _error(lambda: job.ckpt.save(2))  # a scheduler saves its __dict__
    del job.sched.args  # type: ignore[attr-defined]
    x, y = next(job.batches())
    with job.ddp.no_sync():
        F.cross_entropy(job.ddp(x), y).backward()
    out["mid_window"] = _error(lambda: job.ckpt.save(2))
    out["saved"] = _listed(root / "d")
    return out


def _small(kind: str, folder: Path) -> tuple[nn.Module, nn.Module, Any, Checkpointer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if kind == "master":  # bf16 weights, fp32 main gradients and master weights
        model = model.to(torch.bfloat16)
        ddp = gradsync.DistributedDataParallel(model, main_grad_dtype=torch.float32)
        opt: Any = MasterWeights(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        ddp = gradsync.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return model, ddp, opt, Checkpointer(folder, model=ddp, optimizer=opt)


def _steps(rank: int, model: nn.Module, ddp: nn.Module, opt: Any, steps: range) -> list:
    dtype = next(model.parameters()).dtype
    for step in steps:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        ddp(x.to(dtype)).float().pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _before_the_first_step(rank: int, world: int, root: Path) -> dict:
    """A checkpoint taken before the first optimizer step changes nothing, and resumes to a
    run that never stopped; with MasterWeights too (fp32 weights and state by name)."""
    out = {}
    for kind in ("plain", "master"):
        folder = root / f"first-{kind}"
        never = _steps(rank, *_small(kind, root / f"never-{kind}")[:3], range(4))
        model, ddp, opt, ckpt = _small(kind, folder)
        ckpt.save(0)
        _steps(rank, model, ddp, opt, range(2))
        ckpt.save(2)
        saved = _steps(rank, model, ddp, opt, range(2, 4))
        model, ddp, opt, ckpt = _small(kind, folder)
        _steps(rank, model, ddp, opt, range(3))  # a stepped optimizer, then step 0 loaded
        ckpt.load(folder / "step_00000000")
        from_zero = _steps(rank, model, ddp, opt, range(4))
        model, ddp, opt, ckpt = _small(kind, folder)
        ckpt.load()
        from_two = _steps(rank, model, ddp, opt, range(2, 4))
        runs = {"saved": saved, "from 0": from_zero, "from 2": from_two}
        out[f"{kind} differ"] = [
            name
            for name, run in runs.items()
            if not all(torch.equal(a, b) for a, b in zip(run, never, strict=True))
        ]
    return out


def _grid(rank: int, world: int, root: str, other_world: str) -> dict:
    out = _resume_equals_never_stopping(rank, world, Path(root))
    out |= _before_the_first_step(rank, world, Path(root))
    out |= _corrupted_checkpoints(rank, world, Path(root))
    out |= _refusals(rank, world, Path(root))
    if other_world:  # a checkpoint saved by a job of another world size
        job = Job(rank, world, other_world)
        out["other_world"] = _error(job.ckpt.load)
    return out


def test_training_checkpoints_resume_exactly_and_refuse_what_they_cannot_load(
    tmp_path: Path,
) -> None:
    spawn(_grid, 3, (str(tmp_path / "w3"), ""))
    outs = spawn(_grid, 2, (str(tmp_path / "w2"), str(tmp_path / "w3" / "run")))
    for rank, out in enumerate(outs):
        # Resume: every parameter, optimizer tensor, the LR and the RNG equal never stopping.
        assert out["fresh"] is None and out["resumed_at"] == 4
        assert out["differ"] == [] and out["step_counter"] == 7
        assert out["plain differ"] == [] and out["master differ"] == []
        assert out["kept"] == ["step_00000004", "step_00000007"]
        # Corruption: the newest that verifies is loaded, the others named and skipped.
        result, warned = out["flipped"]
        assert result == 2, result
        if rank == 0:
            assert "step_00000003/__1_0.distcp: SHA-256 differs" in warned[0], warned
        assert "CheckpointError" in out["flipped_path"] and "SHA-256" in out["flipped_path"]
        assert out["truncated"][0] == 1, out["truncated"]
        assert "__0_0.distcp: 100 bytes, the manifest says" in out["truncated_path"]
        result, _ = out["missing"]
        assert result.startswith("CheckpointError: gradsync: no checkpoint in"), result
        assert "step_00000001/__0_0.distcp: missing" in result
        assert "step_00000002/__0_0.distcp: 100 bytes" in result and "SHA-256" in result
        if rank == 0:
            assert ".step_00000004.partial" in out["partial_warned"][0]
        assert ".step_00000004.partial" not in out["after_restart"]
        # Refused, on every rank, before anything is written.
        assert "different model" in out["other_model"], out["other_model"]
        assert "'model.inp.weight': checkpoint has (16, 4)" in out["other_model"]
        assert (
            "UsageError" in out["unloadable"]
            and "state['lr_scheduler']['args']" in out["unloadable"]
        )
        assert "accumulation window" in out["mid_window"], out["mid_window"]
        assert out["saved"] == ["step_00000001"]
        # A per-rank sampler position cannot move to another world size (test_checkpoint_resize).
        assert "saved by 3 ranks and cannot continue on 2" in out["other_world"], out
        assert "keeps a position per rank" in out["other_world"], out["other_world"]
