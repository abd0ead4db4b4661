"""What the always-on step timeline costs a step: gradsync with it on and off, and torch DDP.

    python benchmarks/straggler_cost.py                      # the main job's GPT, 3 ranks
    python benchmarks/straggler_cost.py --world 1            # one process: pure bookkeeping
    python benchmarks/straggler_cost.py --rounds 40 --steps 3
    python benchmarks/straggler_cost.py --micro-only         # only the in-process micro-benchmark
    python benchmarks/straggler_cost.py --model mlp --rounds 200 --steps 10   # steps of a few ms

Three variants of the same model train side by side in one run on ``--world`` gloo CPU ranks (one
thread each): gradsync with the step timeline on (``straggler_every=10``, the default), gradsync
with it off (``straggler_every=0``: nothing measured, carried or judged) and torch's
``DistributedDataParallel``. Every round times ``--steps`` full training steps (zero_grad,
forward, backward, optimizer step) of each variant in an order shuffled every round
(``round_order``, the same on every rank); each block starts at a barrier and lasts as long as
its slowest rank. Prints each variant's median
step, the ratios between medians (on/off is the timeline's overhead; the target is at most 1 %),
and the median of the per-round ratios (each round's variants share that round's noise).
``--control`` adds a second, identical timeline-off variant (built last): an A/A check of what
two variants doing the same work differ by in this harness.

The model is the main job's (``examples/train_gpt.py``): GPT with 4 layers, 128 wide, 4 heads,
block 64, vocabulary 27 (its corpus), float64, AdamW(lr 3e-3, weight decay 0.01), a global
batch of 32 sequences split over the ranks (10 per rank at 3 ranks, 32 in one process).

Then, in this process and without any distributed run, the per-step Python work itself, in
microseconds: a step's ``PhaseRecorder`` marks (forward, backward, one launch per bucket, the
optimizer's hooks, the sync, ``resolve``), writing this rank's slots and decoding every rank's,
``attribute()`` on a window of 10 steps x 3 and x 64 ranks (run once every ``straggler_every``
steps), and ``StepTimeline.received`` over many steps (everything a rank does with the records
after a step's readout, the every-10-steps report included).

Caveat of running the variants in one process: the optimizer's phase is timed by torch's
*global* optimizer step hooks, so while the timeline-on wrapper is alive its recorder is also
told about the other variants' optimizer steps (a few microseconds each, counted in their
steps, not in the on variant's: the on/off ratio understates that part; the micro-benchmark
counts it in full).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.bench.steptime import round_order
from gradsync.ddp.tail import GivenRider, TailLayout
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.spawn import spawn
from gradsync.timing import RankStep, StepTimeline, Thresholds
from gradsync.timing import slots as timing_slots
from gradsync.timing.attribution import attribute
from gradsync.timing.clock import HostClock
from gradsync.timing.phases import PHASES, PhaseRecorder, _post_step, _pre_step
from gradsync.timing.slots import decode, encode

ON, OFF, TORCH = "gradsync, timeline on (every 10)", "gradsync, timeline off", "torch DDP"
OFF2 = "gradsync, timeline off (2nd copy)"  # --control: what two identical variants differ by


class _Count(logging.Handler):
    """Counts the straggler logger's records (and keeps them off stderr)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_level: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.by_level[record.levelname] = self.by_level.get(record.levelname, 0) + 1


def _quiet_logger() -> _Count:
    log = logging.getLogger("gradsync.stragglers")
    log.setLevel(logging.INFO)  # a report that names nobody goes out at INFO: count those too
    log.propagate = False
    handler = _Count()
    log.addHandler(handler)
    return handler


def _mlp() -> torch.nn.Module:
    """The tiny MLP of straggler_false_positives.py: 64-256-256-10, float32."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))  # fmt: skip


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank body: per variant, the seconds per step of every timed round."""
    counter = _quiet_logger()
    gpt_cfg = GPTConfig(
        vocab_size=cfg["vocab"], block_size=cfg["block_size"], n_layer=cfg["n_layer"],
        n_head=cfg["n_head"], n_embd=cfg["n_embd"],
    )  # fmt: skip
    dtype = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(rank)  # each rank its own batch, as in data parallelism
    if cfg["model"] == "gpt":
        shape = (cfg["batch_per_rank"], cfg["block_size"])
        x = torch.randint(0, cfg["vocab"], shape, generator=g)
        y = torch.randint(0, cfg["vocab"], shape, generator=g)
        loss_fn: Callable[..., torch.Tensor] = lm_loss
    else:
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        loss_fn = torch.nn.functional.cross_entropy
    steps: dict[str, Callable[[], None]] = {}
    wrappers: dict[str, Any] = {}
    for name in (ON, OFF, TORCH, OFF2) if cfg["control"] else (ON, OFF, TORCH):
        torch.manual_seed(0)
        module = GPT(gpt_cfg).to(dtype) if cfg["model"] == "gpt" else _mlp()
        if name == TORCH:
            model: torch.nn.Module = TorchDDP(module)
        else:
            model = gradsync.DistributedDataParallel(
                module, straggler_every=cfg["every"] if name == ON else 0
            )
        wrappers[name] = model
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        steps[name] = step
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg["warmup"] + cfg["rounds"]):
        for name in round_order(names, r):  # the same shuffle on every rank
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                steps[name]()
            elapsed = torch.tensor((time.perf_counter() - t0) / cfg["steps"], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # as long as its slowest rank
            if r >= cfg["warmup"]:
                times[name].append(elapsed.item())
    on = wrappers[ON]
    return {
        "times": times,
        "num_buckets": on.num_buckets,
        "num_params": sum(p.numel() for p in on.parameters()),
        "logged": dict(counter.by_level),
        "history": len(on.timeline.history),
    }


# ---------------------------------------------------------------------------------------------
# In-process micro-benchmark of the per-step Python work


def _best_us(fn: Callable[[], object], number: int, repeats: int) -> tuple[float, float]:
    """(median, min) microseconds per call of ``fn`` over ``repeats`` batches of ``number``."""
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(per_call), min(per_call)


def _records(world: int, num_buckets: int, rng: random.Random) -> list[RankStep | None]:
    """One step's records of ``world`` ranks: plausible phases (ms) with a little noise."""
    out: list[RankStep | None] = []
    for _ in range(world):
        phases = (rng.uniform(0.5, 2), rng.uniform(90, 110), rng.uniform(180, 220),
                  rng.uniform(20, 25), rng.uniform(5, 30))  # fmt: skip
        launches = tuple(sorted(rng.uniform(100, 330) for _ in range(num_buckets)))
        out.append(RankStep(phases, launches))
    return out


def micro(num_buckets: int, every: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(what, median us per call, min us per call, calls per step) for each piece of work."""
    rng = random.Random(0)
    rows: list[tuple[str, float, float, float]] = []
    _quiet_logger()
    opt = object()  # what the hooks pass through: only its id() is used

    rec = PhaseRecorder(HostClock())

    def marks() -> None:
        rec.forward_began()
        rec.forward_ended()
        for b in range(num_buckets - 1, -1, -1):  # buckets launch last layer first
            rec.launched(b)
        rec.backward_ended()
        rec.synced()
        rec.resolve()
        rec.optimizer_began(opt)
        rec.optimizer_ended(opt)

    med, best = _best_us(marks, 2000, repeats)
    rows.append((f"PhaseRecorder: a step's marks ({num_buckets} launches) + resolve", med, best, 1))

    # torch calls the global hooks on every optimizer step, whether any recorder is live or not;
    # with one live recorder (``rec``) this is their whole cost.
    def hooks() -> None:
        _pre_step(opt, (), {})  # type: ignore[arg-type]
        _post_step(opt, (), {})  # type: ignore[arg-type]

    med, best = _best_us(hooks, 5000, repeats)
    rows.append(("optimizer step hooks (pre + post, 1 live recorder)", med, best, 1))

    for world in (3, 64):
        width = 1 + len(PHASES) + num_buckets
        tail = TailLayout(world, 1, [GivenRider(timing_slots.RIDER, width)])
        values = torch.zeros(width * world, dtype=torch.float64)
        record = _records(1, num_buckets, rng)[0]

        def write(t: TailLayout = tail, r: RankStep = record, v: torch.Tensor = values) -> None:
            t.write(v, {timing_slots.RIDER: encode(r, num_buckets)})

        med, best = _best_us(write, 2000, repeats)
        rows.append((f"encode + TailLayout.write (world {world})", med, best, 1))
        flat = [float(v) for rec_ in _records(world, num_buckets, rng) if rec_ is not None
                for v in (1.0, *rec_.phases, *rec_.launches)]  # fmt: skip
        med, best = _best_us(lambda f=flat, w=world: decode(f, w), 500, repeats)
        rows.append((f"slots.decode, every rank's record (world {world})", med, best, 1))

    for world in (3, 64):
        window = [(s, _records(world, num_buckets, rng)) for s in range(every)]
        # one rank a few ms late in most steps, so the report also names someone
        for _, recs in window[: every - 2]:
            slow = recs[0]
            assert slow is not None
            recs[0] = RankStep((slow.phases[0] + 30, *slow.phases[1:]), slow.launches)
        n = 200 if world == 3 else 20
        med, best = _best_us(lambda w=window: attribute(w, Thresholds()), n, repeats)
        rows.append((f"attribute(): window of {every} steps x {world} ranks", med, best, 1 / every))

    for world in (3, 64):
        tl = StepTimeline(every, 0, world, torch.device("cpu"))
        tail = TailLayout(world, 0, tl.riders(num_buckets))  # as the reducer lays it out
        values = torch.zeros(tail.numel, dtype=torch.float64)
        steps = [_records(world, num_buckets, rng) for _ in range(50)]
        flats = [[v for r_ in recs if r_ is not None for v in (1.0, *r_.phases, *r_.launches)]
                 for recs in steps]  # fmt: skip

        def one_step(
            tl: StepTimeline = tl, tail: TailLayout = tail, flats: list = flats,
            values: torch.Tensor = values, n: list = [0],  # noqa: B006
        ) -> None:  # fmt: skip
            i = n[0] = n[0] + 1
            rec_ = tl.recorder
            rec_.forward_began()
            rec_.forward_ended()
            tail.write(values, i)  # the timeline's rider encodes its own record
            for b in range(num_buckets - 1, -1, -1):
                rec_.launched(b)
            rec_.backward_ended()
            rec_.synced()
            tl.received(flats[i % len(flats)], i)
            _pre_step(opt, (), {})  # type: ignore[arg-type]
            _post_step(opt, (), {})  # type: ignore[arg-type]

        med, best = _best_us(one_step, 10 * every * (10 if world == 3 else 1), repeats)
        rows.append((f"all of it: a step of StepTimeline, report every {every} (world {world})",
                     med, best, 1))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=3)
    p.add_argument(
        "--model", choices=["gpt", "mlp"], default="gpt",
        help="mlp: the tiny MLP of straggler_false_positives.py (steps of a few ms)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--every", type=int, default=10, help="straggler_every of the 'on' variant")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=27, help="the main job's corpus has 27 chars")
    p.add_argument("--global-batch", type=int, default=32, help="split over the ranks")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--micro-repeats", type=int, default=15)
    p.add_argument(
        "--control", action="store_true",
        help="add a second, identical timeline-off variant (built last): the floor of\n"
        "differences between variants that do the same work",
    )  # fmt: skip
    p.add_argument("--micro-only", action="store_true")
    p.add_argument(
        "--micro-buckets", type=int, default=9,
        help="bucket launches per step in --micro-only (the main job's GPT has 9)",
    )  # fmt: skip
    p.add_argument("--no-micro", action="store_true")
    args = p.parse_args()
    cfg = dict(
        vocab=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
        n_embd=args.n_embd, dtype=args.dtype,
        batch_per_rank=max(1, args.global_batch // args.world),
        model=args.model, control=args.control, every=args.every, warmup=args.warmup,
        rounds=args.rounds,
        steps=args.steps,
    )  # fmt: skip
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(
        f"{datetime.date.today()} | {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load:.1f} at start, torch {torch.__version__}, gloo over loopback, {args.world} "
        f"rank(s) x 1 thread"
    )
    step_ms = None
    num_buckets = args.micro_buckets
    if not args.micro_only:
        t_start = time.perf_counter()
        out = spawn(run_rank, args.world, (cfg,), pg_timeout_s=300, timeout_s=3600)
        r0 = out[0]
        times = r0["times"]
        num_buckets = r0["num_buckets"]
        what = (
            f"GPT {args.n_layer}x{args.n_embd} ({r0['num_params'] / 1e6:.2f}M parameters, "
            f"{args.dtype}, {num_buckets} gradsync bucket(s)), batch {cfg['batch_per_rank']}x"
            f"{args.block_size} per rank"
            if args.model == "gpt"
            else f"MLP 64-256-256-10 ({r0['num_params'] / 1e6:.3f}M parameters, float32, "
            f"{num_buckets} gradsync bucket(s)), batch 32 per rank"
        )
        print(
            what + f", AdamW | {args.rounds} rounds x {args.steps} steps per "
            f"variant after {args.warmup} warm-up rounds, order rotated | "
            f"{time.perf_counter() - t_start:.0f} s, load average {os.getloadavg()[0]:.1f} at end"
        )
        med = {name: statistics.median(ts) for name, ts in times.items()}
        step_ms = med[OFF] * 1e3
        print()
        print("| variant | median step (ms) | vs timeline off | vs torch DDP |")
        print("|---|---:|---:|---:|")
        for name in times:
            print(f"| {name} | {med[name] * 1e3:.2f} | {med[name] / med[OFF]:.4f} | "
                  f"{med[name] / med[TORCH]:.4f} |")  # fmt: skip
        print()
        print("| ratio | of medians | median of per-round ratios | per-round 25th-75th pct |")
        print("|---|---:|---:|---|")
        pairs = [(ON, OFF), (ON, TORCH), (OFF, TORCH)] + ([(OFF2, OFF)] if OFF2 in times else [])
        for a, b in pairs:
            per = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
            q = statistics.quantiles(per, n=4)
            print(f"| {a} / {b} | {med[a] / med[b]:.4f} ({med[a] / med[b] - 1:+.2%}) | "
                  f"{statistics.median(per):.4f} ({statistics.median(per) - 1:+.2%}) | "
                  f"{q[0]:.3f} - {q[2]:.3f} |")  # fmt: skip
        print()
        logged = r0["logged"]
        print(
            f"timeline-on wrapper, rank 0: {r0['history']} steps in history; reports logged: "
            f"{logged.get('WARNING', 0)} straggler lines (WARNING), {logged.get('INFO', 0)} "
            f"'no straggler' (INFO). (Its intervals span the other variants' steps and the "
            f"barriers, so its reports say nothing about this run's stragglers.)"
        )
    if not args.no_micro:
        rows = micro(num_buckets, args.every, args.micro_repeats)
        print()
        print(f"In-process micro-benchmark ({num_buckets} bucket launches per step, median / min "
              f"of {args.micro_repeats} batches):")  # fmt: skip
        share = f" | share of a {step_ms:.3g} ms step" if step_ms else ""
        print(f"| work | us per call (median) | min | calls per step | us per step{share} |")
        print("|---|---:|---:|---:|---:|" + ("---:|" if step_ms else ""))
        for what, m, lo, per_step in rows:
            cost = m * per_step
            extra = f" | {cost / (step_ms * 1e3):.4%}" if step_ms else ""
            print(f"| {what} | {m:.1f} | {lo:.1f} | {per_step:g} | {cost:.1f}{extra} |")


if __name__ == "__main__":
    main()
