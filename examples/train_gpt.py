"""The main job: train a small GPT on N CPU processes with gradsync, and prove it equals 1 process.

To run in one process (no torchrun: a world of one):

    python examples/train_gpt.py

To run on 2 ranks of one node (``make train`` does, with ``--timeline``):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

To run on 2 nodes of 1 rank each (R = 0 on the first node, whose address is HOST0; 1 on the other):

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 \\
        --master-addr HOST0 --master-port 29500 examples/train_gpt.py

To restart every rank from the newest checkpoint when one is killed:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 examples/train_gpt.py

The global batch stays fixed whatever the world size: each rank takes ``global_batch / N``
sequences, chosen by a ``DistributedSampler`` reshuffled every epoch with ``set_epoch``. At the
end rank 0 retrains the same model in one process on the same global batches and prints the
largest parameter difference: PASS means N-process training was the same computation. With
``--compression bf16|fp16|powersgd`` the gradients travel in a lossy format: the job then prints
the final losses of both runs (the final weights on a fixed set of sequences) and passes when
the compressed run's exceeds the exact one's by at most the format's band (0.5 %, 0.5 %, 2 %).
``--compression torch-powersgd`` runs torch's own ``powerSGD_hook`` through
``register_comm_hook``, for comparison. ``--warmup-steps`` and ``--clip-grad-norm`` give the
recipe of the wire-quality runs (benchmarks/2026-11-23-wire-quality.md).

Every ``--save-every`` steps all ranks save the whole training state (model, optimizer, data
position, RNG states) to ``OUT/checkpoints/step_N``; a restarted job (by ``torchrun
--max-restarts``, or by hand) resumes from the newest complete one and ends bit-identical to a
run that never stopped.

With ``--global-batches`` every step is the same global batch at any world size
(``gradsync.data.GlobalBatchSampler``, ``reduction="item_mean"``), so a checkpoint continues on
another number of ranks: ``make train-resize`` trains to ``--stop-at`` on 3 ranks, as if a node
were then lost, resumes on 2, and checks the end against one process as usual.

With ``--deterministic LEAF`` (gradsync's deterministic mode, docs/deterministic.md) each global
batch is cut into leaves of LEAF sequences, each with its own backward, summed in one fixed tree
whatever the world size: the job then checks that its parameters are *the same bits* as one
process computing every leaf's gradient and adding them up the same tree
(``gradsync.comm.tree.naive_tree_sum``), at any number of ranks and in float32 too.

The flags, the data and the model are set up in ``gpt_setup.py``, the 1-process check is in
``gpt_reference.py``: this file is the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

import gradsync
from gradsync.checkpoint import Checkpointer, save_checkpoint
from gradsync.testing.corpus import CharDataset, generate_corpus
from gradsync.testing.gpt import lm_loss

from gpt_reference import check_against_one_process
from gpt_setup import (
    SampleLog,
    Sampler,
    describe,
    init_process_group,
    lr_at,
    make_compression,
    make_loader,
    make_model,
    parse_args,
    register_torch_powersgd,
    report_timeline,
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    rank, world = init_process_group(args.timeout_s)
    dataset = CharDataset(generate_corpus(args.sentences), args.block_size)
    sampler, loader, steps_per_epoch = make_loader(dataset, args, rank, world)
    model = make_model(dataset.vocab_size, args)
    ddp = gradsync.DistributedDataParallel(
        model,
        bucket_cap_mb=args.bucket_cap_mb,
        compression=make_compression(args),
        # Shares of a global batch may differ by one sequence: divide by the step's items.
        reduction="item_mean" if args.global_batches or args.deterministic else "mean",
        deterministic=sampler.leaves_per_step if args.deterministic else None,
        timeout=timedelta(seconds=args.timeout_s),  # a lost peer is named within it
    )
    if args.compression == "torch-powersgd":
        register_torch_powersgd(ddp, args)
    # The 1-process check starts from the same weights: a copy, one more model in memory.
    init_state = {k: v.clone() for k, v in ddp.state_dict().items()}
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    ckpt = Checkpointer(
        os.path.join(args.out, "checkpoints"),
        model=ddp,
        optimizer=opt,
        sampler=sampler,  # each rank's data position
        keep=args.keep,
        timeout=args.timeout_s,
    )
    total = args.max_steps or args.epochs * steps_per_epoch
    load_start = time.time()
    step = 0 if args.no_resume else (ckpt.load() or 0)  # the newest complete checkpoint
    log = SampleLog(args.log_samples, load_start) if args.log_samples else None
    if rank == 0:
        print(describe(args, ddp, steps_per_epoch, step))

    t0 = time.perf_counter()
    step, curve = train(args, ddp, opt, ckpt, sampler, loader, log, step, total)
    elapsed = time.perf_counter() - t0
    if args.stop_at and step == args.stop_at:  # as a lost node: the next job resumes on any N
        if rank == 0:
            print(f"stopped at step {step} on {world} rank(s), checkpoint saved")
        dist.destroy_process_group()
        return 0
    report_timeline(ddp, args.timeline)
    path = os.path.join(args.out, "checkpoint.pt")
    if rank == 0:  # the trained model in one file, for use outside this job
        state = {"model": ddp.state_dict(), "optimizer": opt.state_dict(), "step": step}
        save_checkpoint(state, path)
        print(f"trained {step} steps in {elapsed:.1f} s; checkpoint: {path}")
    dist.destroy_process_group()  # the other ranks are done: rank 0 alone checks the run
    if rank != 0:
        return 0
    return check_against_one_process(model, path, dataset, init_state, curve, args, world)


def train(
    args: argparse.Namespace,
    ddp: gradsync.DistributedDataParallel,
    opt: torch.optim.Optimizer,
    ckpt: Checkpointer,
    sampler: Sampler,
    loader: DataLoader,
    log: SampleLog | None,
    step: int,
    total: int,
) -> tuple[int, dict[int, float]]:
    """The loop, from ``step`` (0, or where a checkpoint left off) to ``total`` or ``--stop-at``.
    Returns the step reached and the loss every 10 steps (mean over ranks)."""
    last = min(total, args.stop_at) if args.stop_at else total
    bar = tqdm(total=total, initial=step, desc="train", disable=dist.get_rank() != 0)
    curve: dict[int, float] = {}
    for epoch in range(sampler.epoch, args.epochs):  # a resumed sampler knows its epoch
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for micro_batches in steps_of(loader, sampler, args):  # after a resume: the rest
            if step == last:
                break
            # A function of the step alone (no scheduler state): a resumed run sets the same.
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args)
            opt.zero_grad()
            for i, (x, y) in enumerate(micro_batches):  # one, except with leaves
                # Only the step's last backward all-reduces; the others add to .grad locally
                # (no_sync): one reduction a step, not one a leaf.
                with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss = lm_loss(ddp(x), y)
                    if args.global_batches or args.deterministic:  # see reduction= above
                        ddp.count_items(len(x))
                        (loss * len(x)).backward()  # a sum: item_mean divides by the total
                    else:
                        loss.backward()  # gradients are averaged over ranks when this returns
            if args.clip_grad_norm > 0:  # the gradients are global: torch's clip sees the norm
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_grad_norm)
            opt.step()
            if log:
                log.write(step, loader.batch_sampler.last)  # this rank's share of the step
            step += 1
            if step % 10 == 0 or step == total:
                # One all-reduce of a scalar, every 10 steps, called by every rank (a
                # rank-0-only collective would hang); .item() waits for it.
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                curve[step] = mean_loss.item() / dist.get_world_size()
                bar.set_postfix(epoch=epoch, loss=f"{curve[step]:.3f}")
            bar.update()
            if args.save_every and step % args.save_every == 0 or step == args.stop_at:
                # Every rank writes its part; save() holds the loop for the write, async_save()
                # only for a copy in memory, and writes in the background.
                (ckpt.async_save if args.async_save else ckpt.save)(step)
        if step == last:
            break
    ckpt.wait()  # an asynchronous save still being written
    bar.close()
    return step, curve


def steps_of(loader: DataLoader, sampler: Sampler, args: argparse.Namespace) -> Iterator[list]:
    """Each step's micro-batches: one per step, or with ``--deterministic`` this rank's leaves."""
    if not args.deterministic:
        yield from ([batch] for batch in loader)
        return
    step: list = []
    for batch, last in sampler.mark_step_ends(loader):
        step.append(batch)
        if last:
            yield step
            step = []


if __name__ == "__main__":
    sys.exit(main())
