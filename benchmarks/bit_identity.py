"""Bit-identity probe: does a change to gradsync leave training bit for bit the same?

A refactor must change no behaviour. This script trains a tiny 3-layer MLP (float32, 316
parameters, fixed seeds) for 6 steps on 2 gloo ranks, each rank on its own data shard, under
each of 20 settings of the wrapper (bucket caps, "auto" included, reductions, unused
parameters, wire formats, the ring, fp32 main gradients of a bf16 model, check_finite, ZeRO-1,
torch's comm hooks, no_sync accumulation, join with uneven data, the deterministic mode), and
saves rank 0's final parameters per setting
(``torch.save`` of ``{setting: {name: tensor}}``; after checking that rank 1's are bitwise the
same). Run it on the code before and after the change, then compare the two files:

    PYTHONPATH=<before>/src python benchmarks/bit_identity.py --out before.pt
    PYTHONPATH=<after>/src python benchmarks/bit_identity.py --out after.pt
    python benchmarks/bit_identity.py --compare before.pt after.pt

``--compare`` prints, per setting, ``identical`` (every tensor bitwise equal, dtype and shape
included) or the largest absolute difference, and exits 1 if any setting differs. Two runs of
the same code give identical files. The settings run one after the other in the same two rank
processes (one thread each; starting processes costs more than training on a loaded machine);
``--isolated`` starts fresh ones for each setting (the same bits, 20x the start-up time), to
tell which setting hangs or crashes. ``--settings NAME ...`` runs only those (``--list``).

``bucket_cap_mb=None`` is the default cap (torch's 25 MiB on these two ranks of one host), so
one bucket is ``bucket_cap_mb=inf``; with this model the default cap already makes one
bucket. The bf16 setting also saves ``MasterWeights``' fp32 copies as ``master.<name>``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import gradsync
from gradsync.testing.spawn import spawn

WORLD = 2
STEPS = 6
BATCH = 8
IGNORE = -100  # cross_entropy's ignore_index: padding that item_mean does not count

# name -> (wrapper keyword arguments, what the loop does besides the plain step)
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "default": ({}, "plain"),
    "bucket_cap_mb=0": ({"bucket_cap_mb": 0}, "plain"),
    "bucket_cap_mb=inf": ({"bucket_cap_mb": math.inf}, "plain"),
    "gradient_as_bucket_view=True": ({"gradient_as_bucket_view": True}, "plain"),
    "reduction=sum": ({"reduction": "sum"}, "sum"),
    "reduction=item_mean": ({"reduction": "item_mean"}, "item_mean"),
    "find_unused_parameters=True": ({"find_unused_parameters": True}, "unused"),
    "compression=bf16": ({"compression": "bf16"}, "plain"),
    "compression=fp16": ({"compression": "fp16"}, "plain"),
    "compression=PowerSGD(2)": ({}, "powersgd"),
    "algorithm=ring": ({"algorithm": "ring"}, "plain"),
    "main_grad_dtype=float32,bf16 model": ({"main_grad_dtype": torch.float32}, "master"),
    "check_finite=True": ({"check_finite": True}, "plain"),
    "shard_optimizer(AdamW)": ({}, "zero"),
    "register_comm_hook(allreduce_hook)": ({}, "allreduce_hook"),
    "register_comm_hook(powerSGD_hook)": ({}, "powersgd_hook"),
    "no_sync,2 micro-batches": ({}, "no_sync"),
    "join(opt),uneven data": ({}, "join"),
    "bucket_cap_mb=auto": ({"bucket_cap_mb": "auto"}, "plain"),
    "deterministic=4,2 leaves a rank": ({"deterministic": 4}, "leaves"),
}


class Mlp(nn.Module):
    """8 -> 16 -> 8 -> 4 (316 parameters); ``branch`` (8 -> 4) only where a step may skip it."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 4)
        self.branch = nn.Linear(8, 4) if branch else None

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        out = self.fc3(h)
        if use_branch and self.branch is not None:
            out = out + self.branch(h)
        return out


def batches(rank: int, mode: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches: its own shard, 2 per step with ``no_sync`` (and in the
    deterministic mode, where each is a leaf), one step fewer on
    rank 1 with ``join``; with ``item_mean`` 0-2 labels per batch are padding."""
    g = torch.Generator().manual_seed(1000 + rank)
    count = STEPS * (2 if mode in ("no_sync", "leaves") else 1) - (rank == 1 and mode == "join")
    out = []
    for i in range(count):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        if mode == "item_mean":
            y[: (i + rank) % 3] = IGNORE
        out.append((x, y))
    return out


def uses_branch(step: int, rank: int) -> bool:
    """Step 0: both ranks use the branch; step 1: rank 0 only; step 2: neither; and again."""
    return step % 3 == 0 or (step % 3 == 1 and rank == 0)


def train(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """One setting on one rank: its final parameters (and MasterWeights' fp32 copies)."""
    kwargs, mode = SETTINGS[name]
    torch.manual_seed(0)
    model = Mlp(branch=mode == "unused")
    dtype = torch.bfloat16 if mode == "master" else torch.float32
    model = model.to(dtype)
    if mode == "powersgd":
        kwargs = {**kwargs, "compression": gradsync.comm.PowerSGD(2, seed=5)}
    ddp = gradsync.DistributedDataParallel(model, timeout=60, **kwargs)
    if mode == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "powersgd_hook":
        state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt: Any
    if mode == "zero":
        opt = ddp.shard_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    elif mode == "master":
        opt = gradsync.optim.MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reduction = "sum" if mode in ("sum", "item_mean") else "mean"

    def backward(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = ddp(x.to(dtype), use_branch=uses_branch(step, rank)).float()
        loss = F.cross_entropy(logits, y, ignore_index=IGNORE, reduction=reduction)
        if mode == "item_mean":
            ddp.count_items((y != IGNORE).sum())
        loss.backward()

    data = batches(rank, mode)
    if mode in ("no_sync", "leaves"):
        for step in range(STEPS):
            opt.zero_grad()
            with ddp.no_sync():
                backward(step, *data[2 * step])
            backward(step, *data[2 * step + 1])
            opt.step()
    else:
        with ddp.join(opt) if mode == "join" else contextlib.nullcontext():
            for step, (x, y) in enumerate(data):
                opt.zero_grad()
                backward(step, x, y)
                opt.step()
    out = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    if mode == "master":
        names = [n for n, _ in ddp.module.named_parameters()]
        out |= {f"master.{n}": m.detach().clone() for n, m in zip(names, opt.master, strict=True)}
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise: dtype, shape and every byte (so -0.0 differs from 0.0, and NaN equals NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))  # fmt: skip


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """``None`` if ``a`` and ``b`` are bitwise equal, else what differs."""
    if a.keys() != b.keys():
        return f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    worst, what = 0.0, []
    for n in a:
        if bits_equal(a[n], b[n]):
            continue
        if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape:
            what.append(f"{n}: {a[n].dtype}{list(a[n].shape)} vs {b[n].dtype}{list(b[n].shape)}")
            continue
        d = (a[n].double() - b[n].double()).abs().max().item()
        worst = d if math.isnan(d) else max(worst, d)
        what.append(n)
    if not what:
        return None
    return f"max abs diff {worst:.3e} ({', '.join(what)})"


def train_all(rank: int, world: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Every setting in ``names``, one after the other, in this rank's process."""
    out = {}
    for name in names:
        out[name] = train(rank, world, name)
        gc.collect()  # the wrapper's worker threads and private group go before the next one
    return out


def run(out: str, names: list[str], isolated: bool) -> int:
    results: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    start = time.perf_counter()
    for group in [[n] for n in names] if isolated else [names]:
        t0 = time.perf_counter()
        per_rank = spawn(train_all, WORLD, (group,), pg_timeout_s=60, timeout_s=600)
        for name in group:
            results[name] = per_rank[0][name]
            diff = difference(per_rank[0][name], per_rank[1][name])
            if diff is not None:
                bad.append(name)
            note = "ranks equal" if diff is None else f"RANK 1 DIFFERS FROM RANK 0: {diff}"
            print(f"{name:<40} {note}", flush=True)
        if isolated:
            print(f"{'':<40} {time.perf_counter() - t0:.1f} s", flush=True)
    torch.save(results, out)
    print(f"{len(names)} settings in {time.perf_counter() - start:.1f} s; saved {out}")
    if bad:
        print(f"replicas differ in: {', '.join(bad)}")
    return 1 if bad else 0


def compare(path_a: str, path_b: str) -> int:
    a, b = (torch.load(p, weights_only=True) for p in (path_a, path_b))
    differ = 0
    for name in [*a, *(n for n in b if n not in a)]:
        if name not in a or name not in b:
            print(f"{name:<40} only in {path_a if name in a else path_b}")
            differ += 1
            continue
        diff = difference(a[name], b[name])
        differ += diff is not None
        print(f"{name:<40} {'identical' if diff is None else diff}")
    print(f"{len(a.keys() | b.keys()) - differ} identical, {differ} differ")
    return 1 if differ else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="train every setting; torch.save the parameters here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="only these settings")
    p.add_argument("--isolated", action="store_true", help="fresh processes for each setting")
    p.add_argument("--list", action="store_true", help="print the setting names and exit")
    args = p.parse_args()
    if args.list:
        print("\n".join(SETTINGS))
        sys.exit(0)
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        p.error("give --out FILE or --compare A B")
    sys.exit(run(args.out, args.settings or list(SETTINGS), args.isolated))


if __name__ == "__main__":
    main()
