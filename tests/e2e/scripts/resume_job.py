"""A tiny training job that checkpoints every few steps and can kill one of its ranks.

    torchrun --max-restarts 1 --nproc-per-node N resume_job.py FOLDER [--kill step|save]
        [--kill-rank R] [--kill-at S]

Everything a resume must get right is on: dropout, shuffling, an LR schedule and two
micro-batches per optimizer step. On the first attempt only (torchrun's restart count 0),
``--kill step`` makes rank R SIGKILL itself in the middle of step S, between its two
micro-batches; ``--kill save`` makes it SIGKILL itself while writing the checkpoint of step S,
after half of its file is on disk. torchrun then restarts every rank; the job resumes from the
newest complete checkpoint, finishes, and each rank writes its final model, optimizer and RNG
state to ``FOLDER/final-<rank>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer, save_checkpoint
from gradsync.data import DistributedSampler

STEPS, SAVE_EVERY, MICRO = 8, 2, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--kill", choices=("none", "step", "save"), default="none")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-at", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill = args.kill if first_attempt and dist.get_rank() == args.kill_rank else "none"
    train(args.folder, kill, args.kill_at)
    dist.destroy_process_group()


def uninterrupted(rank: int, world: int, folder: str) -> None:
    """The job with no fault, on ranks that ``gradsync.testing.spawn`` started (the test's
    reference runs on its pool of ranks, without torchrun)."""
    train(folder)


def train(folder: str, kill: str = "none", kill_at: int = 5) -> None:
    """The job, on the initialised default group."""
    rank = dist.get_rank()
    if kill == "save":
        kill_while_writing(kill_at)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(96, 8, generator=gen), torch.randint(0, 4, (96,), generator=gen)
    )
    sampler = DistributedSampler(data, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    ddp = gradsync.DistributedDataParallel(model, timeout=30)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    torch.manual_seed(1000 + rank)  # each rank's dropout masks are its own
    ckpt = Checkpointer(
        folder, model=ddp, optimizer=opt, lr_scheduler=sched, sampler=sampler, keep=2,
        timeout=60,
    )  # fmt: skip
    step = ckpt.load() or 0
    print(f"RANK {rank} ATTEMPT {os.environ.get('TORCHELASTIC_RESTART_COUNT')} FROM {step}")
    batches = iter(())  # type: Any
    epoch = sampler.epoch
    while step < STEPS:
        for micro in range(MICRO):
            batch = next(batches, None)
            while batch is None:  # the epoch is over (or not started): the next one
                sampler.set_epoch(epoch)
                batches, epoch = iter(loader), epoch + 1
                batch = next(batches, None)
            x, y = batch
            with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                (F.cross_entropy(ddp(x), y) / MICRO).backward()
            if kill == "step" and step + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: between two micro-batches
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if step % SAVE_EVERY == 0:
            ckpt.save(step)
    final = {"model": ddp.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}
    save_checkpoint(final, os.path.join(folder, f"final-{rank}.pt"))


def kill_while_writing(step: int) -> None:
    """SIGKILL this rank inside DCP's write of checkpoint ``step``, half of its file written."""
    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
        future = original(self, plan, planner)
        if f".step_{step:08d}.partial" in str(self.path):
            future.wait()
            for name in os.listdir(self.path):
                if name.startswith(f"__{dist.get_rank()}_"):
                    path = os.path.join(self.path, name)
                    os.truncate(path, os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    dcp.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
