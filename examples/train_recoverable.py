"""A nanoGPT-style loop that a lost rank does not end (``gradsync.recovery``).

    torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        examples/train_recoverable.py --out OUT        # on each of 2 nodes

When a node dies mid-step, the ranks left redo that step over the same global batch among
themselves, in the same processes, and train on; at the end rank 0 retrains the model in one
process on the same global batches and prints the largest parameter difference with PASS or
FAIL (float64: 1e-12). Compared with a plain loop, recovery adds three lines (marked ``+``) and
changes two (``~``): the loop over steps and the micro-batches of the step.

``--tp N`` trains on a dp x tp device mesh: each replica's N ranks hold tensor-parallel shards
of the attention and MLP (torch's ``parallelize_module``), and a lost node takes whole replicas
(start N ranks per node, or a multiple of N); the survivors go on at one replica fewer, their
mesh laid out again in place.

``--log-samples FILE`` appends one JSON record per rank and completed step (its indices, the
world size, the membership generation, the time), for the tests; ``--out`` receives
``result.json`` (the comparison and the recovery events) from rank 0. ``--stop-file FILE`` ends
the job early, after the step during which FILE appears: each rank's view is all-reduced inside
the step with ``step.all_reduce``, so every rank stops after the same one (Lightning's
``should_stop`` idiom), and a rank lost during the vote is recovered from as in any collective.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import IO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.elastic import joining
from gradsync.recovery import Recovery, Step
from gradsync.testing.corpus import CharDataset, generate_corpus
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.parallel import apply_tensor_parallel, full_parameters


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=None, help="default: no accumulation")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=1.0, help="Recovery's roll-call window")
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="pad steps to this many seconds (a larger model's step)",
    )
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--stop-file", default=None, help="end after the step during which it appears")
    p.add_argument("--log-samples", default=None)
    p.add_argument("--out", default="out-recoverable")
    return p.parse_args()


def make_model(vocab_size: int) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPT(config).double()


def schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Cosine decay to a tenth over the run."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    dataset = CharDataset(generate_corpus(args.sentences), 32)
    mesh = mesh_of(args.tp)
    sampler = global_batches(dataset, args, mesh)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model, ddp = wrapped_model(dataset.vocab_size, mesh, args.timeout_s)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = schedule(opt, args.max_steps)
    ckpt = Checkpointer(
        os.path.join(args.out, "checkpoints"),
        model=ddp,
        optimizer=opt,
        lr_scheduler=scheduler,
        sampler=sampler,
    )
    if not joining():  # the restart path: resume from the newest checkpoint, if any
        ckpt.load()
    recovery = Recovery(  # +
        ddp, opt, sampler, lr_scheduler=scheduler, checkpointer=ckpt, window=args.window_s
    )
    publish_store(recovery, args.out)
    log = open(args.log_samples, "a") if args.log_samples else None

    stop = torch.zeros(())
    for step in recovery.steps(args.max_steps):  # ~ for step in range(max_steps):
        started = time.monotonic()
        with step:  # +
            if args.stop_file:  # every rank's view, agreed inside the step (not dist.all_reduce)
                stop.fill_(os.path.exists(args.stop_file))
                step.all_reduce(stop, op=dist.ReduceOp.MAX)
            micro = list(step.micro_batches(loader))  # ~ this rank's share of the global batch
            for i, (x, y) in enumerate(micro):
                ddp.require_backward_grad_sync = i == len(micro) - 1  # nanoGPT's accumulation
                loss = lm_loss(ddp(x), y) * len(x)  # a sum over samples: item_mean divides
                ddp.count_items(len(x))
                loss.backward()
            clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            if args.save_every and (step.number + 1) % args.save_every == 0:
                ckpt.save(step.number + 1)
            time.sleep(max(0.0, args.step_time - (time.monotonic() - started)))
            if log:  # inside the block: code after it runs after an interrupted step too
                log_step(log, step, sampler, recovery)
        if step.completed and stop.item():
            break

    rank = recovery.membership.rank
    params = list(full_parameters(model).values())  # tensor-parallel shards gathered
    dist.destroy_process_group()
    if rank != 0:
        return 0
    return check(params, dataset, args, recovery)


def mesh_of(tp: int) -> DeviceMesh | None:
    """``--tp``: a (dp, tp) mesh over every rank, tp fastest (a node's ranks hold replicas)."""
    if tp == 1:
        return None
    return init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))


def wrapped_model(
    vocab_size: int, mesh: DeviceMesh | None, timeout_s: float
) -> tuple[GPT, gradsync.DistributedDataParallel]:
    """The model (its attention and MLP sharded over ``tp`` on a mesh) and its wrapper."""
    model = make_model(vocab_size)
    if mesh is not None:
        apply_tensor_parallel(model, mesh["tp"])
    dp = None if mesh is None else mesh["dp"]
    ddp = gradsync.DistributedDataParallel(
        model, device_mesh=dp, reduction="item_mean", timeout=timeout_s
    )
    return model, ddp


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> None:
    """torch's clipping, or on a mesh gradsync's: torch's refuses DTensor and plain gradients
    mixed, and the tensor-parallel shards' norm must be taken over their mesh."""
    params = list(parameters)
    if any(isinstance(p, DTensor) for p in params):
        gradsync.clip_grad_norm_(params, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def global_batches(
    dataset: CharDataset, args: argparse.Namespace, mesh: DeviceMesh | None
) -> GlobalBatchSampler:
    """The steps' global batches, split over the ranks, or on a mesh over the dp replicas
    (every tp rank of a replica reads the same share)."""
    dp = None if mesh is None else mesh["dp"]
    return GlobalBatchSampler(
        dataset,
        args.global_batch,
        args.micro_batch,
        drop_last=True,
        num_replicas=None if dp is None else dp.size(),
        rank=None if dp is None else dp.get_local_rank(),
    )


def publish_store(recovery: Recovery, out: str) -> None:
    """Rank 0 of the first membership writes the job's store address to ``OUT/job-store``: a
    replacement node joins with ``GRADSYNC_JOIN=<that address>``."""
    if dist.get_rank() == 0 and recovery.membership.generation == 0 and recovery.store_address:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "job-store"), "w") as f:
            f.write(recovery.store_address)


def log_step(log: IO[str], step: Step, sampler: GlobalBatchSampler, recovery: Recovery) -> None:
    """``--log-samples``: one JSON line for this rank's share of a completed step."""
    me = recovery.membership
    record = {
        "step": step.number,
        "rank": me.rank,
        "indices": [i for batch in sampler.micro_batches_of(step.index) for i in batch],
        "world": me.world_size,
        "generation": me.generation,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "pid": os.getpid(),
        "time": time.time(),
    }
    print(json.dumps(record), file=log, flush=True)  # one write a line: ranks share the file


def check(
    params: list[torch.Tensor], dataset: CharDataset, args: argparse.Namespace, recovery: Recovery
) -> int:
    """Rank 0, at the end: the same steps in one process, PASS or FAIL, and ``result.json``."""
    reference = train_one_process(dataset, args, recovery.completed)
    pairs = zip(params, reference.parameters(), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    verdict = "PASS" if diff <= 1e-12 else "FAIL"
    world = recovery.membership.world_size
    print(
        f"{verdict}: {world} rank(s) left after {recovery.completed} steps and "
        f"{len(recovery.events)} membership change(s); largest parameter difference to one "
        f"process {diff:.3g}"
    )
    result = {"verdict": verdict, "diff": diff, "world": world, "steps": recovery.completed}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({**result, "events": recovery.events}, f)
    return 0 if verdict == "PASS" else 1


def train_one_process(dataset: CharDataset, args: argparse.Namespace, steps: int) -> GPT:
    """The same ``steps`` steps in one process, on the same global batches (the learning rate's
    schedule spans ``--max-steps`` in both)."""
    model = make_model(dataset.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = schedule(opt, args.max_steps)
    one = GlobalBatchSampler(dataset, args.global_batch, num_replicas=1, rank=0, drop_last=True)
    done = 0
    while done < steps:  # over epochs, as recovery.steps() goes
        for indices in itertools.islice(one, steps - done):
            x, y = (torch.stack(t) for t in zip(*[dataset[i] for i in indices], strict=True))
            lm_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            done += 1
        one.set_epoch(one.epoch + 1)
    return model


if __name__ == "__main__":
    raise SystemExit(main())
