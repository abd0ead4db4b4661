"""What ``train_gpt.py`` sets up around its loop: the flags, the process group, the sampler and
loader, the model, the wire format, and what the job prints and logs.

A user who copies the loop brings their own model and data; the samplers (``gradsync.data``:
a resumable ``DistributedSampler``, or ``GlobalBatchSampler`` for the same global batches at any
world size) are the part to keep.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.utils.data import BatchSampler, DataLoader

import gradsync
from gradsync.data import DistributedSampler, GlobalBatchSampler
from gradsync.ddp.plan import parse_cap
from gradsync.testing.corpus import CharDataset
from gradsync.testing.gpt import GPT, GPTConfig

Sampler = DistributedSampler | GlobalBatchSampler


# -- flags -----------------------------------------------------------------------------------------
def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawTextHelpFormatter
    p = argparse.ArgumentParser(description=description, formatter_class=formatter)
    add_training_args(p.add_argument_group("training"))
    add_wire_args(p.add_argument_group("gradient synchronisation"))
    add_checkpoint_args(p.add_argument_group("checkpoints"))
    add_check_args(p.add_argument_group("the check against 1 process, and outputs"))
    args = p.parse_args(argv)
    if args.timeline and importlib.util.find_spec("matplotlib") is None:  # before any work
        p.exit(2, "--timeline needs matplotlib: pip install 'gradsync[bench]'\n")
    return args


def add_training_args(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all)")
    p.add_argument("--sentences", type=int, default=3000, help="size of the generated corpus")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up of the rate")
    p.add_argument(
        "--clip-grad-norm", type=float, default=0.0, help="clip the gradients' norm (0: never)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    p.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float64 (default) makes the final comparison exact to ~1e-9: in float32, rounding\n"
        "differences of a few ulps per step grow chaotically over hundreds of Adam steps\n"
        "(a 1-process run that merely sums its batch in another order drifts as far)",
    )


def add_wire_args(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--bucket-cap-mb",
        type=parse_cap,
        default=None,
        help="MiB, 'none' (one bucket), 'scaled' or 'auto' (default: the library's, torch's 25\n"
        "on one host, 'scaled' across hosts)",
    )
    p.add_argument(
        "--compression",
        choices=["none", "bf16", "fp16", "powersgd", "torch-powersgd"],
        default="none",
        help="wire format of the gradients (DistributedDataParallel(compression=...)); a lossy\n"
        "one cannot match 1 process to 1e-7: the check then compares final losses instead.\n"
        "torch-powersgd: torch's own powerSGD_hook, through register_comm_hook",
    )
    p.add_argument("--powersgd-rank", type=int, default=4, help="rank of PowerSGD's matrices")
    p.add_argument(
        "--powersgd-start-iter", type=int, default=0, help="exact steps before PowerSGD starts"
    )
    p.add_argument(
        "--global-batches",
        action="store_true",
        help="gradsync.data.GlobalBatchSampler: every step is the same global batch whatever\n"
        "the world size (any N, not only divisors of --global-batch; reduction='item_mean'),\n"
        "so a checkpoint continues on another number of ranks (see --stop-at)",
    )
    p.add_argument(
        "--deterministic",
        type=int,
        default=0,
        metavar="LEAF",
        help="the deterministic mode with leaves of LEAF sequences: the same bits at any N",
    )
    p.add_argument("--timeout-s", type=float, default=120.0, help="process group + gradsync (s)")


def add_checkpoint_args(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--out", default="runs/gpt", help="folder for the checkpoints")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (0: never)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--no-resume", action="store_true", help="start at step 0 despite checkpoints")
    p.add_argument(
        "--stop-at", type=int, default=0, help="save at this step and exit, as a lost node would"
    )


def add_check_args(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--eval-sequences", type=int, default=512, help="for the final loss")
    p.add_argument("--tolerance", type=float, default=None, help="PASS threshold")
    p.add_argument("--no-reference", action="store_true", help="skip the 1-process comparison")
    p.add_argument("--losses-out", help="write the loss every 10 steps (mean over ranks), JSON")
    p.add_argument("--log-samples", help="append each rank's sample indices per step (JSON lines)")
    p.add_argument(
        "--timeline",
        help="at the end, plot every rank's step phases over the last 100 steps to this file\n"
        "(PNG/SVG/PDF; needs matplotlib: pip install 'gradsync[bench]')",
    )


# -- processes, data, model ------------------------------------------------------------------------
def init_process_group(timeout_s: float) -> tuple[int, int]:
    """gloo among torchrun's ranks; under plain ``python``, a world of one through a private
    file store. Returns (rank, world size)."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


class LastBatch:
    """A batch sampler that remembers the indices it last handed out (for ``--log-samples``)."""

    def __init__(self, batches: Any) -> None:  # a batch sampler: __iter__ and __len__
        self.batches, self.last = batches, []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            self.last = list(batch)
            yield batch


def make_loader(
    dataset: CharDataset, args: argparse.Namespace, rank: int, world: int
) -> tuple[Sampler, DataLoader, int]:
    """This rank's sampler and loader, and the optimizer steps in an epoch.

    By default each rank takes ``global_batch / N`` sequences a step from torch's
    ``DistributedSampler`` (gradsync's adds a resumable position). ``--global-batches`` cuts
    every global batch the same at any N; ``--deterministic`` cuts it into leaves.
    """
    sampler: Sampler
    if args.deterministic:  # this rank's leaves of each global batch, several a step
        sampler = GlobalBatchSampler(
            dataset,
            args.global_batch,
            args.deterministic,
            seed=args.seed,
            drop_last=True,
            deterministic=True,
        )
    elif args.global_batches:  # this rank's share of each global batch, one micro-batch a step
        sampler = GlobalBatchSampler(dataset, args.global_batch, seed=args.seed, drop_last=True)
    elif args.global_batch % world:
        raise ValueError(
            f"--global-batch {args.global_batch} is not divisible by world size {world} "
            "(--global-batches takes any world size)"
        )
    else:
        sampler = DistributedSampler(dataset, world, rank, seed=args.seed, drop_last=True)
    if isinstance(sampler, DistributedSampler):  # it hands out indices: batch them
        batches = LastBatch(BatchSampler(sampler, args.global_batch // world, drop_last=True))
    else:  # it hands out batches
        batches = LastBatch(sampler)
    loader = DataLoader(dataset, batch_sampler=batches)  # in this process: batches.last is x's
    steps_per_epoch = sampler.steps_per_epoch if args.deterministic else len(batches)
    return sampler, loader, steps_per_epoch


def make_model(vocab_size: int, args: argparse.Namespace) -> GPT:
    """The same initial weights on every rank (and in the reference): the seed decides them."""
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size=vocab_size, block_size=args.block_size)
    return GPT(config).to(getattr(torch, args.dtype))


def make_compression(args: argparse.Namespace) -> str | gradsync.comm.PowerSGD | None:
    if args.compression in ("none", "torch-powersgd"):
        return None
    if args.compression == "powersgd":
        return gradsync.comm.PowerSGD(rank=args.powersgd_rank, start_iter=args.powersgd_start_iter)
    return str(args.compression)


def register_torch_powersgd(ddp: gradsync.DistributedDataParallel, args: Any) -> None:
    """torch's own PowerSGD hook, for comparison; it counts from 2 exact steps at least."""
    start = max(2, args.powersgd_start_iter)
    state = powerSGD.PowerSGDState(None, args.powersgd_rank, start_powerSGD_iter=start)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Cosine decay from ``--lr`` to a tenth of it over the run, after ``--warmup-steps`` of
    linear warm-up. A function of the step alone (no scheduler state), so a resumed run sets
    the same rate; and a run that ends on a small rate ends on settled weights, whose loss says
    more than one taken mid-oscillation."""
    lr = args.lr
    if args.lr_schedule == "cosine":
        lr *= 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(total, 1)))
    if step < args.warmup_steps:
        lr *= (step + 1) / args.warmup_steps
    return lr


# -- what the job prints and logs ------------------------------------------------------------------
def describe(
    args: argparse.Namespace, ddp: gradsync.DistributedDataParallel, steps: int, start: int
) -> str:
    """The first line rank 0 prints: the layout, the buckets, the data, where it starts."""
    n_params = sum(p.numel() for p in ddp.parameters())
    return (
        f"gradsync: {dist.get_world_size()} rank(s), {n_params / 1e6:.2f}M parameters, "
        f"{ddp.num_buckets} bucket(s) (cap {ddp.bucket_cap_mb:g} MiB), global batch "
        f"{args.global_batch} x {args.block_size} tokens, {steps} steps/epoch, "
        f"compression {args.compression}"
        + (f", deterministic ({ddp.deterministic} leaves)" if args.deterministic else "")
        + (f"; resumed at step {start}" if start else "")
    )


class SampleLog:
    """``--log-samples``: one JSON line per rank and step with this rank's sample indices, its
    world size and torchrun's attempt, for the tests that check which samples a resumed job
    used (tests/e2e/test_node_loss.py)."""

    def __init__(self, path: str, load_start: float) -> None:
        self.file = open(path, "a")  # open for the whole job
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun's restarts
        world = dist.get_world_size()
        self.times = dict(attempt=attempt, world=world, load_start=load_start, load_end=time.time())

    def write(self, step: int, indices: list[int]) -> None:
        record = dict(step=step, rank=dist.get_rank(), indices=indices, time=time.time())
        # One flushed write per line: ranks sharing the file never mix lines.
        print(json.dumps({**record, **self.times}), file=self.file, flush=True)


def report_timeline(ddp: gradsync.DistributedDataParallel, path: str | None) -> None:
    """Rank 0 prints the step timeline's last report and, with ``--timeline``, plots it."""
    if dist.get_rank() != 0 or not ddp.timeline.history:
        return
    report = ddp.timeline.report(last=len(ddp.timeline.history))
    named = ", ".join(
        f"rank {s['rank']} ({s['phase']}, +{s['late_ms']:.1f} ms)" for s in report["stragglers"]
    )
    print(
        f"step timeline, last {report['num_steps']} steps: median step {report['step_ms']:.1f} ms, "
        f"stragglers: {named or 'none'}"
    )
    if path:
        from gradsync.bench.phase_plot import plot_step_phases

        title = "train_gpt.py: step phases per rank"
        plot_step_phases(ddp.timeline.history, path, title=title)
        print(f"step timeline plot: {path}")
