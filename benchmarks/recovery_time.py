"""What in-process recovery costs and saves: per step while nothing fails, and per lost node.

    python benchmarks/recovery_time.py [--rounds 5] [--runs 3] [--skip-nodes]

1. **Per step** (2 local ranks, gloo): the bench's GPT (4 layers x 512, 12.7M parameters,
   float32, AdamW, a LambdaLR schedule, global batch 8 x 64 tokens) trained by a plain loop and
   by the same loop under ``gradsync.recovery.Recovery``, in alternating rounds of 8 steps;
   medians of the slowest rank's step time, and their ratio round by round. Also timed alone,
   on rank 0: the step-start snapshot (``StepStart.take``), what a step under recovery does
   more. Then each loop alone in fresh processes, for memory: peak RSS and the tensor bytes
   ``Recovery`` holds, beside the bytes of the parameters and AdamW's state.
2. **Per lost node** (2 simulated nodes x 2 ranks under torchrun, node 1 killed mid-step): the
   restart path (``tests/e2e/test_node_loss.py``: torchrun restarts the survivors, which load
   the newest checkpoint) and in-process recovery
   (``tests/e2e/test_recovery_nodes.py::test_a_lost_node_costs_one_step_redone_in_process``),
   run alternately ``--runs`` times; each prints its timeline, and the medians are shown side
   by side.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.recovery import Recovery
from gradsync.recovery.rollback import StepStart
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=8, n_embd=512)
GLOBAL_BATCH = 8


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.block_size + 1), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i, :-1], self.x[i, 1:]


def slowest(seconds: float) -> float:
    t = torch.tensor(seconds)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def alternate(
    body: Callable[[list[list[int]]], None],
    sampler: GlobalBatchSampler,
    recovery: Recovery,
    rounds: int,
) -> dict[str, list[float]]:
    """The slowest rank's step times of ``body`` (one step over its micro-batches' indices) in
    a plain loop and under ``recovery``, in alternating rounds of 8 steps after a warm-up."""
    times: dict[str, list[float]] = {"plain loop": [], "under Recovery": []}
    for r in range(rounds + 1):  # round 0 warms up both
        for name in times:
            for _ in range(8):
                t0 = time.perf_counter()
                if name == "plain loop":
                    body(sampler.micro_batches_of(sampler.step))
                    sampler.step += 1
                    recovery.completed += 1
                else:
                    step = next(recovery.steps())
                    with step:
                        body(sampler.micro_batches_of(step.index))
                elapsed = slowest(time.perf_counter() - t0)
                if r:
                    times[name].append(elapsed)
    return times


def print_ratios(times: dict[str, list[float]]) -> None:
    """The medians of :func:`alternate`'s times and their ratio, round by round."""
    plain, under = times["plain loop"], times["under Recovery"]
    by_round = [
        statistics.median(under[i : i + 8]) / statistics.median(plain[i : i + 8])
        for i in range(0, len(plain), 8)
    ]
    print(f"  plain loop       {statistics.median(plain) * 1e3:8.1f} ms")
    print(f"  under Recovery   {statistics.median(under) * 1e3:8.1f} ms")
    ratios = ", ".join(f"{r:.3f}" for r in by_round)
    print(f"  ratio, round by round: median {statistics.median(by_round):.3f} ({ratios})")


def _per_step(rank: int, world: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = _Tokens(GLOBAL_BATCH * 16 * (rounds + 2))
    ddp = gradsync.DistributedDataParallel(GPT(CONFIG), reduction="item_mean")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, shuffle=False)
    loader = torch.utils.data.DataLoader(data)
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched)

    def body(indices: list[list[int]]) -> None:
        for idx in indices:
            x, y = loader.collate_fn([data[i] for i in idx])
            loss = lm_loss(ddp(x), y) * len(x)
            ddp.count_items(len(x))
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    times = alternate(body, sampler, recovery, rounds)
    parts: dict[str, float] = {}
    if rank == 0:  # what a step under Recovery does more, alone
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            StepStart.take(ddp.module, opt, sched, sampler)
            samples.append(time.perf_counter() - t0)
        parts["StepStart.take"] = statistics.median(samples)
    return {"times": times, "parts": parts}


def _memory(rank: int, world: int, under: bool) -> dict:
    """One loop alone in a fresh process: its peak RSS, the bytes of the parameters and the
    optimizer state, and the tensor bytes Recovery holds (its step starts)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = _Tokens(GLOBAL_BATCH * 8)
    ddp = gradsync.DistributedDataParallel(GPT(CONFIG), reduction="item_mean")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, shuffle=False)
    loader = torch.utils.data.DataLoader(data)
    recovery = Recovery(ddp, opt, sampler) if under else None
    for index in range(6):
        step = next(recovery.steps()) if recovery is not None else nullcontext()
        with step:
            for idx in sampler.micro_batches_of(index):
                x, y = loader.collate_fn([data[i] for i in idx])
                loss = lm_loss(ddp(x), y) * len(x)
                ddp.count_items(len(x))
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if recovery is None:
            sampler.step += 1
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = 0
    if recovery is not None:
        for start in recovery._starts.values():
            held += sum(b.nbytes for b in start.buffers) + start.rng.nbytes
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "model_and_optimizer": sum(t.nbytes for t in [*ddp.parameters(), *state]),
        "held": held,
    }


def per_step(rounds: int) -> None:
    result = spawn(_per_step, 2, (rounds,), timeout_s=1800)[0]
    print(f"per step, 2 ranks, {rounds} rounds of 8 steps each (medians, slowest rank):")
    print_ratios(result["times"])
    for name, seconds in result["parts"].items():
        print(f"  {name:40s} {seconds * 1e3:8.2f} ms")
    # The allocator's peak moves by several MiB between identical runs: medians of 3 each.
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(3):
        for u in runs:
            runs[u].append(spawn(_memory, 2, (u,), fresh=True, timeout_s=600)[0])
    alone = {u: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for u, rs in runs.items()}
    base = alone[False]["model_and_optimizer"]
    grown = alone[True]["peak_rss"] - alone[False]["peak_rss"]
    print(f"memory, rank 0, medians of 3 fresh runs each ({base / 2**20:.1f} MiB of parameters")
    print("and AdamW state):")
    held = alone[True]["held"]
    print(f"  tensors Recovery holds   {held / 2**20:8.2f} MiB ({held / base:.2%})")
    print(f"  peak RSS, plain loop     {alone[False]['peak_rss'] / 2**20:8.1f} MiB")
    print(f"  peak RSS, under Recovery {alone[True]['peak_rss'] / 2**20:8.1f} MiB")
    print(f"  peak RSS grown by        {grown / 2**20:+8.1f} MiB ({grown / base:+.2%} of them)")


def _run(test: str, marker: str) -> dict | None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith(marker):
            return dict(json.loads(line[len(marker) :]))
    print(f"  ({test} printed no timeline; exit {out.returncode})\n{out.stdout[-2000:]}")
    return None


def per_node(runs: int) -> None:
    scenarios = {
        "restart path": ("tests/e2e/test_node_loss.py", "elastic recovery:"),
        "in-process": (
            "tests/e2e/test_recovery_nodes.py::test_a_lost_node_costs_one_step_redone_in_process",
            "in-process recovery:",
        ),
    }
    found: dict[str, list[dict]] = {name: [] for name in scenarios}
    for i in range(runs):
        for name, (test, marker) in scenarios.items():
            timeline = _run(test, marker)
            print(f"run {i + 1}, {name}: {json.dumps(timeline)}")
            if timeline:
                found[name].append(timeline)
    print("\nmedians over the runs (seconds):")
    for name, timelines in found.items():
        if not timelines:
            continue
        print(f"  {name}:")
        for key in timelines[0]:
            values = [t[key] for t in timelines if isinstance(t.get(key), (int, float))]
            if values:
                print(f"    {key:60s} {statistics.median(values):9.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip-nodes", action="store_true", help="only the per-step part")
    args = p.parse_args()
    per_step(args.rounds)
    if not args.skip_nodes:
        per_node(args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
