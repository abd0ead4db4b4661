"""The 3-D main job: the same GPT on a (dp, cp, tp) device mesh, proven equal to 1 process.

Launch (``make train-3d`` runs the first line; dp is the world size / (cp * tp)):

    torchrun --standalone --nproc-per-node 8 examples/train_3d.py --cp 2 --tp 2   # dp2 x cp2 x tp2
    torchrun --standalone --nproc-per-node 4 examples/train_3d.py --tp 2          # dp2 x tp2

- tp: torch's ``parallelize_module`` splits each block's attention and MLP weights over the tp
  ranks (their parameters are DTensors); the tp ranks see the same data.
- cp: every sequence is split into cp chunks, one per rank; attention all-gathers the keys and
  values of the other chunks (``gradsync.testing.parallel``).
- dp: the global batch's rows are split over the dp ranks.

gradsync synchronises gradients over dp and cp together (``device_mesh=mesh["dp", "cp"]``),
never over tp. At the end rank 0 trains the same GPT in one process on the same global batches
and prints the largest parameter difference: PASS means the 3-D run was the same computation.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from tqdm import tqdm

import gradsync
from gradsync.ddp.plan import parse_cap
from gradsync.testing import mesh_run
from gradsync.testing.corpus import CharDataset, generate_corpus
from gradsync.testing.gpt import GPTConfig
from gradsync.testing.parallel import full_parameters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--bucket-cap-mb", type=parse_cap, default=None,
        help="MiB, 'none' (one bucket), 'scaled' or 'auto' (default: the library's, torch's 25 "
        "on one host, 'scaled' across hosts)",
    )  # fmt: skip
    p.add_argument("--tolerance", type=float, default=1e-9, help="PASS threshold (float64)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    return p.parse_args(argv)


def global_batches(dataset: CharDataset, steps: int, batch: int) -> list[mesh_run.Batch]:
    """Every step's global batch, the same on every rank (each takes its part of it)."""
    g = torch.Generator().manual_seed(0)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(dataset), generator=g).tolist()
        for b in range(len(order) // batch):
            if len(out) == steps:
                break
            samples = [dataset[i] for i in order[b * batch : (b + 1) * batch]]
            out.append((torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])))
    return out


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % (args.cp * args.tp):
        raise ValueError(f"world size {world} is not divisible by cp * tp = {args.cp * args.tp}")
    layout = mesh_run.Layout(dp=world // (args.cp * args.tp), cp=args.cp, tp=args.tp)
    mesh = layout.build_mesh()

    dataset = CharDataset(generate_corpus(600), args.block_size)
    cfg = GPTConfig(
        vocab_size=dataset.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
        n_embd=args.n_embd,
    )  # fmt: skip
    batches = global_batches(dataset, args.steps, args.global_batch)
    model = mesh_run.make_model(cfg, mesh, seed=0, dtype=torch.float64)
    ddp = gradsync.DistributedDataParallel(
        model, device_mesh=mesh_run.data_parallel_mesh(mesh), bucket_cap_mb=args.bucket_cap_mb
    )
    opt = make_optimizer(ddp.parameters(), args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())  # global sizes, DTensors too
        print(
            f"gradsync 3-D: dp{layout.dp} x cp{layout.cp} x tp{layout.tp} = {world} ranks, "
            f"{n_params / 1e6:.2f}M parameters, {ddp.num_buckets} bucket(s), global batch "
            f"{args.global_batch} x {args.block_size} tokens, {args.steps} steps"
        )
    t0 = time.perf_counter()
    losses = []
    for batch in tqdm(batches, desc="train", disable=rank != 0):
        losses += mesh_run.train(ddp, opt, [batch], mesh)
    elapsed = time.perf_counter() - t0
    final = full_parameters(model)  # a collective over tp: every rank gathers its shards
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"trained {args.steps} steps in {elapsed:.1f} s; last local loss {losses[-1]:.3f}")
    reference = mesh_run.train_reference(
        cfg, lambda ps: make_optimizer(ps, args.lr), batches, seed=0, dtype=torch.float64
    )
    diff = max((final[n] - reference[n]).abs().max().item() for n in reference)
    # float64 rounding differences (~1e-16 per step: the mesh splits every sum differently)
    # grow slowly over the AdamW steps; a missed or extra reduction over an axis moves the
    # parameters by ~1e-3 within a step.
    ok = diff <= args.tolerance
    print(
        f"max |param({world} ranks, dp{layout.dp} x cp{layout.cp} x tp{layout.tp}) - "
        f"param(1 process)| = {diff:.3g} (float64, tolerance {args.tolerance:g}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
