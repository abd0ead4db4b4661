"""Time training checkpoints: gradsync's Checkpointer (sync and async save, load) against
``torch.save`` of the same state on rank 0, for the main job's GPT and a ~100M-parameter GPT.

    python benchmarks/checkpoint_time.py [--ranks 2] [--out /tmp/ckpt-bench]

Every number is the slowest rank's (a barrier before and after), median over the repeats:

- ``Checkpointer.save``: DCP, every rank writes its part (fsync), SHA-256 of every file,
  manifest, commit by rename.
- ``async_save`` stall: how long the call blocks training (the CPU copy of the state; the
  first call also allocates the copy's memory, later calls refill it); ``async_save`` total:
  until the background write has committed.
- ``Checkpointer.load``: checksums verified, then DCP reads the state into the live objects.
- ``save_checkpoint`` on rank 0: gradsync's one-file save (atomic, fsync) of the model and
  optimizer ``state_dict()``s while the other ranks wait; ``torch.save`` is the same without the
  temp file, fsync and rename. Loads: every rank reads the file (``load_checkpoint`` checks the
  CRC-32s first).
- Training stall per save (main job's model only): extra wall time of 8 training steps with one
  save at the first step, against 8 steps without.

Files are read back from the page cache right after being written: loads measure CPU work and
memory copies, not the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.spawn import spawn

MODELS = {  # name: (config, dtype, repeats)
    "main job GPT": (GPTConfig(vocab_size=40, block_size=64), torch.float64, 5),
    "GPT ~100M": (
        GPTConfig(vocab_size=256, block_size=64, n_layer=14, n_head=12, n_embd=768),
        torch.float32,
        3,
    ),
}


def _slowest(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.barrier()
    return float(elapsed)


def _train_step(ddp, opt, x, y) -> None:  # type: ignore[no-untyped-def]
    opt.zero_grad()
    lm_loss(ddp(x), y).backward()
    opt.step()


def _bench(rank: int, world: int, name: str, folder: str) -> dict[str, float]:
    cfg, dtype, repeats = MODELS[name]
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(GPT(cfg).to(dtype))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    _train_step(ddp, opt, x, x)  # optimizer state exists
    root = Path(folder) / name.replace(" ", "_")
    ckpt = Checkpointer(root / "dcp", model=ddp, optimizer=opt, keep=1, timeout=600)
    file = root / "rank0.pt"
    times: dict[str, list[float]] = {}

    def record(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    def async_stall() -> None:
        t0 = time.perf_counter()
        ckpt.async_save(step)
        stall = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        first = "async_save stall" not in times and "async_save stall, first" not in times
        record("async_save stall, first" if first else "async_save stall", float(stall))
        ckpt.wait()

    def state() -> dict:
        return {"model": ddp.state_dict(), "optimizer": opt.state_dict()}

    for _ in range(repeats):
        step = _next()
        record("Checkpointer.save", _slowest(lambda: ckpt.save(step)))  # noqa: B023
        step = _next()
        record("async_save total", _slowest(async_stall))
        record("Checkpointer.load", _slowest(ckpt.load))
        record(
            "save_checkpoint, rank 0",
            _slowest(lambda: rank == 0 and save_checkpoint(state(), file)),
        )
        record("torch.save, rank 0", _slowest(lambda: rank == 0 and torch.save(state(), file)))
        record("load_checkpoint, every rank", _slowest(lambda: load_checkpoint(file)))
        record("torch.load, every rank", _slowest(lambda: torch.load(file, weights_only=True)))
    if name == "main job GPT":
        _training_stall(ddp, opt, ckpt, x, record)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["parameters (M)"] = sum(p.numel() for p in ddp.parameters()) / 1e6
    out["checkpoint MiB"] = sum(f.stat().st_size for f in root.glob("dcp/step_*/*")) / 2**20
    return out


def _training_stall(ddp, opt, ckpt, x, record) -> None:  # type: ignore[no-untyped-def]
    """Extra wall time of 8 steps with one save at the first, over 8 steps without; a
    background write still running after the 8th step is waited for outside the timing."""

    def train(save: Callable[[int], object] | None) -> float:
        def run() -> None:
            for i in range(8):
                _train_step(ddp, opt, x, x)
                if i == 0 and save is not None:
                    save(_next())

        seconds = _slowest(run)
        ckpt.wait()
        return seconds

    for _ in range(3):
        base = train(None)
        record("stall per save: save", train(ckpt.save) - base)
        record("stall per save: async_save", train(ckpt.async_save) - base)


_counter = iter(range(1000, 10**9))


def _next() -> int:
    return next(_counter)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temp dir)")
    args = p.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="gradsync-ckpt-bench-")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    try:
        for name in MODELS:
            results[name] = spawn(_bench, args.ranks, (name, folder), timeout_s=1200)[0]
            shutil.rmtree(Path(folder) / name.replace(" ", "_"), ignore_errors=True)
    finally:
        if args.out is None:
            shutil.rmtree(folder, ignore_errors=True)
    keys = list(next(iter(results.values())).keys())
    print(f"| {args.ranks} gloo ranks, torch {torch.__version__} | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for key in keys:
        cells = [results[n].get(key) for n in results]
        unit = "" if key in ("parameters (M)", "checkpoint MiB") else " s"
        text = [f"{c:.3f}{unit}" if c is not None else "-" for c in cells]
        print(f"| {key} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
