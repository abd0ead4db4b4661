"""What the wrapper costs when there is nothing to communicate: world size 1.

    python benchmarks/hook_overhead.py                  # CPU, gloo
    python benchmarks/hook_overhead.py --device cuda    # one GPU, NCCL
    python benchmarks/hook_overhead.py --n-layer 4 --n-embd 512 --batch 4 --compression powersgd

Times forward + backward of the same GPT without a wrapper, under torch's
DistributedDataParallel and under gradsync's, interleaved round by round in one process (a
world of one, so every difference is bookkeeping: hooks, bucket copies, the end-of-backward
callback, the write-back), and prints each wrapper's median overhead over the bare module, per
step, per parameter (microseconds) and as a share of the step. The issue's target: gradsync's
overhead at most torch DDP's plus 2 % of the step. ``--compression powersgd`` (or ``bf16``) adds
gradsync with that wire format: with one rank PowerSGD still does all of its arithmetic (the
rank-r approximation, error feedback), so its row is what that arithmetic costs a step, the part
of a PowerSGD step that no link speed removes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.bench.steptime import round_order
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss


def make_step(model: torch.nn.Module, wrapped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
              ) -> Callable[[], None]:  # fmt: skip
    def step() -> None:
        model.zero_grad(set_to_none=True)
        lm_loss(wrapped(x), y).backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--compression", choices=["bf16", "powersgd"], default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    store = os.path.join(tempfile.mkdtemp(), "store")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    cfg = GPTConfig(vocab_size=64, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=4, n_embd=args.n_embd)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (args.batch, args.block_size), generator=g).to(args.device)
    y = torch.roll(x, -1, dims=1)
    steps: dict[str, Callable[[], None]] = {}
    models = {}
    names = ["bare module", "torch DDP", "gradsync"]
    if args.compression is not None:
        names.append(f"gradsync, compression={args.compression}")
    for name in names:
        torch.manual_seed(0)
        model = GPT(cfg).to(args.device)
        models[name] = model
        if name == "bare module":
            wrapped: torch.nn.Module = model
        elif name == "torch DDP":
            wrapped = TorchDDP(model, device_ids=[0] if cuda else None)
        elif name == "gradsync":
            wrapped = gradsync.DistributedDataParallel(model)
        else:
            wire = args.compression
            compression = gradsync.comm.PowerSGD(4) if wire == "powersgd" else wire
            wrapped = gradsync.DistributedDataParallel(model, compression=compression)
        steps[name] = make_step(model, wrapped, x, y)
    n_params = sum(1 for p in models["bare module"].parameters())
    n_elems = sum(p.numel() for p in models["bare module"].parameters())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds + 3):
        for name in round_order(list(steps), r):  # no variant always first, or after another
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                steps[name]()
            sync()
            if r >= 3:  # 3 untimed rounds: allocator, autotuning, lazy init
                times[name].append((time.perf_counter() - t0) / args.steps_per_round)
    base = statistics.median(times["bare module"])
    print(f"world size 1, {args.device} ({backend}), torch {torch.__version__}: GPT with "
          f"{n_params} parameter tensors ({n_elems / 1e6:.2f}M elements), batch "
          f"{args.batch} x {args.block_size}; median of {args.rounds} rounds of "
          f"{args.steps_per_round} forward+backward steps")  # fmt: skip
    print("| variant | step (ms) | overhead (ms) | per parameter (us) | share of step |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        over = med - base
        print(f"| {name} | {med * 1e3:.3f} | {over * 1e3:+.3f} | {over / n_params * 1e6:+.1f} | "
              f"{over / base:+.1%} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
