"""How much of the library one training step runs through: files, functions and calls.

    python benchmarks/step_trace.py            # 2 gloo ranks, rank 0 traced
    python benchmarks/step_trace.py --list     # and every function, with its call count

A reader follows one step through the code; this counts what they would have to read. Each rank
wraps a small MLP with the defaults (buffers broadcast, the straggler timeline on), runs three
steps to warm up, then rank 0 traces one step (forward, backward, ``opt.step()``,
``zero_grad()``) with ``sys.setprofile``: every Python call whose code lies in ``gradsync``
counts, on the thread that runs the step (on CPU autograd runs the backward, its hooks and its
end-of-backward callback on that thread). Lambdas count as calls of their own, as a reader meets
them; comprehensions are counted both ways.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradsync

COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")
PACKAGE = str(Path(gradsync.__file__).resolve().parent)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _trace(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> collections.Counter:
    calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            where = os.path.relpath(frame.f_code.co_filename, PACKAGE)
            calls[(where, frame.f_code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        _step(model, opt, x)
    finally:
        sys.setprofile(None)
    return calls


def _rank(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = gradsync.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        _step(model, opt, x)
    calls = _trace(model, opt, x)
    if rank == 0:
        torch.save(dict(calls), out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--list", action="store_true", help="every function and its calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calls.pt")
        init = f"file://{tmp}/rendezvous"
        mp.spawn(_rank, args=(args.world_size, init, out), nprocs=args.world_size)
        calls: dict[tuple[str, str], int] = torch.load(out)
    files = sorted({f for f, _ in calls})
    named = {k: n for k, n in calls.items() if not k[1].endswith(COMPREHENSIONS)}
    print(f"one training step, rank 0 of {args.world_size}: {len(files)} library files, ")
    print(f"  {len(calls)} functions, {sum(calls.values())} calls (comprehensions apart: ")
    print(f"  {len(named)} functions, {sum(named.values())} calls)")
    for f in files:
        mine = {fn: n for (g, fn), n in calls.items() if g == f}
        print(f"  {f}: {len(mine)} functions, {sum(mine.values())} calls")
        if args.list:
            for fn, n in sorted(mine.items()):
                print(f"      {n:5d}  {fn}")


if __name__ == "__main__":
    main()
