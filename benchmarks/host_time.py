"""Where a host-bound step's time goes, phase by phase: gradsync's host work beside torch DDP's.

    python benchmarks/host_time.py                        # 1 and 2 loopback ranks
    python benchmarks/host_time.py --worlds 2 --rounds 60 --out runs/host_time.json
    python benchmarks/host_time.py --profile              # + gradsync's ranges, torch.profiler

The model is ``gradsync bench --where host``'s (:mod:`gradsync.bench.hostbound`: 150
``nn.Linear(8, 8)``, 300 parameter tensors, compute tiny beside the work per parameter). Five
replicas train side by side on every rank (torchrun, gloo, one thread per rank), each in its
own call of every round, in an order shuffled every round (``time_interleaved``, 10 steps a
call): the module alone; the module with an empty post-accumulate-grad hook on every parameter
(what autograd's call into Python costs, before any library does anything); torch DDP at its
defaults; gradsync at its defaults; and gradsync at its defaults with its phases timed.

Method: wall clock (``time.perf_counter_ns``), per rank. Every replica's step is cut into
forward (with the loss), backward and optimizer (``zero_grad`` and ``step``). The instrumented
gradsync replica also has its own methods wrapped, on that replica's objects only (never the
classes: the plain replica runs untouched), each wrapper adding its call's time to a phase and
taking out the time of the wrapped calls inside it, so the phases do not overlap and add up to
the step (:data:`POINTS` lists them). ``torch.profiler`` with gradsync's ranges
(``gradsync::bucket_copy_in`` ... ``bucket_write_back``) is the other way; on this model it
records thousands of tiny operators a step, which makes a profiled step about 1.35x as long, and
its ranges miss the reduction's start (``--profile`` prints its table and how much longer a
profiled step is). The wrappers cost time too: the
report gives the instrumented replica's step beside the plain one's, which is what the phases
are accurate to. torch DDP's per-parameter work runs in C++ inside autograd, where no Python
wrapper reaches it: its phases are forward, backward and optimizer, beside the module's alone.

Rank 0 prints markdown tables (medians over rounds of each round's mean per step; the
backward's wait includes waiting for the other ranks) and, with ``--out``, writes the JSON.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.bench import launch
from gradsync.bench.hostbound import HostBoundConfig, host_batch, host_model
from gradsync.bench.steptime import time_interleaved

TAG = "HOST_TIME_JSON"
PARTS = ("forward", "backward", "optimizer")
RECORDER_MARKS = ("forward_began", "forward_ended", "backward_ended", "launched", "synced")
RECORDER_MARKS += ("optimizer_began", "optimizer_ended")
POINTS: tuple[tuple[str, str], ...] = (
    ("step start: the forward protocol", "wrapper._prepare_forward"),
    ("the module's forward", "wrapper._run_module"),
    ("hooks, per parameter", "reducer.on_grad_ready"),
    ("reduction start (first hook): the rest", "reducer._start_reduction"),
    ("reduction start: buffers laid out again", "reducer._claim_buffers"),
    ("reduction start: bucket 0's tail written", "reducer.tail.write"),
    ("bucket launches (copy-in, flags, start)", "reducer.queue._launch"),
    ("end of backward: launch the rest", "reducer.queue.launch_rest"),
    ("end of backward: wait", "reducer._wait_all"),
    ("end of backward: readout, checks", "reducer.finish_gradient_synchronization"),
    ("end of backward: post-divide", "reducer._post_divide"),
    ("end of backward: write-back", "reducer._write_back"),
    ("end of backward: reset", "reducer._reset"),
    *(("step timeline: marks", f"timeline.recorder.{mark}") for mark in RECORDER_MARKS),
    ("step timeline: records (after the readout)", "timeline.received"),
    ("step timeline: records (into the tail)", "timeline.outgoing"),
)
"""(phase, where): the methods of the instrumented gradsync replica whose calls make each
phase; ``where`` starts at the wrapper, its reducer or its timeline. A phase's time leaves out
the wrapped calls inside it ("readout, checks" is what the end of backward does besides the
phases under it). What no point covers stays in the part of the step it ran in: the forward's
(the wrapper's own frames, the loss), the backward's (autograd: compute and its calls into the
hooks) and the optimizer's."""
FORWARD_PHASES = ("step start: the forward protocol", "the module's forward")


class PhaseTimer:
    """Exclusive wall-clock time per phase: a call's time less that of the timed calls inside."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._inner = [0]  # time of timed calls inside each open call, innermost last
        self.missing: list[str] = []

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, inner = time.perf_counter_ns, self._inner
        self.ns.setdefault(phase, 0)
        self.calls.setdefault(phase, 0)

        def call(*args: Any, **kwargs: Any) -> Any:
            inner.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                self.ns[phase] += elapsed - inner.pop()
                self.calls[phase] += 1
                inner[-1] += elapsed

        return call

    def instrument(self, roots: dict[str, Any], points: tuple[tuple[str, str], ...]) -> None:
        """Replace each point's method on its object (the instance, not its class)."""
        for phase, where in points:
            root, *path, name = where.split(".")
            obj = roots[root]
            for attr in path:
                obj = getattr(obj, attr, None)
            if getattr(obj, name, None) is None:
                self.missing.append(where)  # moved by a change to the library: say so
                continue
            setattr(obj, name, self.timed(phase, getattr(obj, name)))

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """(ns, calls) per phase since the last take, and start again."""
        taken = dict(self.ns), dict(self.calls)
        self.ns = dict.fromkeys(self.ns, 0)
        self.calls = dict.fromkeys(self.calls, 0)
        return taken


def wrapper_cost(n: int = 100_000) -> tuple[float, float]:
    """Nanoseconds a :class:`PhaseTimer` call adds to a call of a no-op: (in all, inside the
    call's own clock window). The part inside lands in the call's phase, the rest in the
    phase of its caller."""
    timer = PhaseTimer()

    def noop() -> None:
        return None

    timed = timer.timed("noop", noop)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        noop()
    plain = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    for _ in range(n):
        timed()
    wrapped = time.perf_counter_ns() - t0
    return (wrapped - plain) / n, timer.ns["noop"] / n


def timed_step(
    model: nn.Module, module: nn.Module, timer: PhaseTimer, batch: tuple[torch.Tensor, ...]
) -> Callable[[], None]:
    """One training step with its forward, backward and optimizer timed as phases of
    ``timer`` (which also holds any phases inside them)."""
    x, y = batch
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def forward() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    def optimizer() -> None:
        opt.step()
        opt.zero_grad()  # after the step, not before the forward: one part of the step

    fwd = timer.timed("forward", forward)
    bwd = timer.timed("backward", lambda loss: loss.backward())
    step_opt = timer.timed("optimizer", optimizer)

    def step() -> None:
        bwd(fwd())
        step_opt()

    return step


def replicas(cfg: HostBoundConfig) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Name -> (model to call, module to optimize)."""
    import gradsync

    hooked = host_model(cfg)
    for p in hooked.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    out: dict[str, tuple[nn.Module, nn.Module]] = {"module alone": (host_model(cfg),) * 2}
    out["module + empty hooks"] = (hooked, hooked)
    module = host_model(cfg)
    out["torch DDP"] = (torch.nn.parallel.DistributedDataParallel(module), module)
    for name in ("gradsync", "gradsync, instrumented"):
        module = host_model(cfg)
        out[name] = (gradsync.DistributedDataParallel(module), module)
    return out


def rank_main(args: argparse.Namespace) -> None:
    """Every rank under torchrun: :func:`measure`; rank 0 prints the JSON line."""
    torch.set_num_threads(1)
    # A rank stuck past the limit prints where it is and exits, instead of outliving torchrun.
    faulthandler.dump_traceback_later(max(args.timeout - 10.0, 1.0), exit=True)
    dist.init_process_group("gloo")
    try:
        result = measure(args)
    finally:
        dist.destroy_process_group()
    if result is not None:
        print(TAG, json.dumps(result), flush=True)


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank of the default group: time the replicas; rank 0 returns every rank's
    numbers, the others ``None``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = HostBoundConfig(num_layers=args.layers, width=args.width, batch_per_rank=args.batch)
    batch, k = host_batch(rank, cfg), args.steps_per_round
    models = replicas(cfg)
    timers = {name: PhaseTimer() for name in models}
    steps = {n: timed_step(m, mod, timers[n], batch) for n, (m, mod) in models.items()}
    for _ in range(3):  # torch DDP rebuilds its buckets in gradient-ready order
        for step in steps.values():
            step()
    ours = models["gradsync, instrumented"][0]
    roots = {"wrapper": ours, "reducer": ours.reducer, "timeline": ours.timeline}
    timers["gradsync, instrumented"].instrument(roots, POINTS)
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    calls: dict[str, dict[str, int]] = {}

    def task(name: str) -> Callable[[], None]:
        def run() -> None:
            timers[name].take()
            for _ in range(k):
                steps[name]()
            ns, calls[name] = timers[name].take()
            phases[name].append({p: v / k / 1e3 for p, v in ns.items()})  # us per step

        return run

    times = time_interleaved(
        {name: task(name) for name in models}, warmup=args.warmup, rounds=args.rounds
    )
    profiled = profile_steps(models["gradsync"][0], steps["gradsync"]) if args.profile else None
    every_rank = [None] * world
    dist.all_gather_object(every_rank, {n: p[args.warmup :] for n, p in phases.items()})
    if rank != 0:
        return None
    return {
        "world": world,
        "torch": torch.__version__,
        "steps_per_round": k,
        "step_us": {n: [t / k * 1e6 for t in ts] for n, ts in times.items()},
        "phases_us": every_rank,
        "calls_per_step": {n: {p: c / k for p, c in c_.items()} for n, c_ in calls.items()},
        "missing": timers["gradsync, instrumented"].missing,
        "wrapper_ns": wrapper_cost(),
        "profile": profiled,
    }


def profile_steps(model: nn.Module, step: Callable[[], None], n: int = 20) -> dict[str, Any]:
    """``n`` steps under ``torch.profiler`` (CPU): gradsync's ranges per step, and the
    profiled steps' wall clock against as many plain ones just before."""
    from torch.profiler import ProfilerActivity, profile

    from gradsync.bench.trace import summarize

    t0 = time.perf_counter()
    for _ in range(n):
        step()
    plain = (time.perf_counter() - t0) / n
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        profiled = (time.perf_counter() - t0) / n
    rows = [(name, count / n, ms * 1e3 / n) for name, count, ms in summarize(prof.key_averages())]
    return {"plain_us": plain * 1e6, "profiled_us": profiled * 1e6, "ranges": rows[:-1]}


def med(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def part_table(result: dict[str, Any]) -> str:
    """Rank 0's forward, backward and optimizer per replica, the whole step (slowest rank),
    and each over the module alone's."""
    rank0 = result["phases_us"][0]
    local = {p: med([r[p] for r in rank0["module alone"]]) for p in PARTS}
    local_step = med(result["step_us"]["module alone"])
    lines = [
        "| replica | forward | backward | optimizer | step (slowest rank) | step over the "
        "module alone |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rounds in rank0.items():
        if name == "gradsync, instrumented":
            continue
        parts = {p: med([r[p] for r in rounds]) for p in PARTS}
        cells = " | ".join(f"{parts[p]:.0f} ({parts[p] - local[p]:+.0f})" for p in PARTS)
        step = med(result["step_us"][name])
        lines.append(f"| {name} | {cells} | {step:.0f} | {step - local_step:+.0f} |")
    return "\n".join(lines)


def phase_table(result: dict[str, Any]) -> str:
    """The instrumented gradsync replica's phases, per rank, in microseconds per step."""
    name = "gradsync, instrumented"
    ranks = [r[name] for r in result["phases_us"]]
    calls = result["calls_per_step"][name]
    timed = [p for p in dict.fromkeys(phase for phase, _ in POINTS) if p in calls]
    inside = [p for p in timed if p not in FORWARD_PHASES and not p.startswith("step timeline")]
    forward = [p for p in timed if p in FORWARD_PHASES]
    timeline = [p for p in timed if p.startswith("step timeline")]
    order = ["forward", *forward, "backward", *inside, "optimizer", *timeline]
    head = " | ".join(f"rank {r} (us)" for r in range(len(ranks)))
    lines = [f"| phase | calls a step | {head} |", "|---|---:|" + "---:|" * len(ranks)]
    for phase in order:
        label = {"forward": "forward, the rest (loss, wrapper frames)"}.get(phase, phase)
        label = {"backward": "backward, the rest (autograd, hook calls)"}.get(phase, label)
        label = {"optimizer": "optimizer (zero_grad, step)"}.get(phase, label)
        cells = " | ".join(f"{med([r.get(phase, 0.0) for r in rounds]):.0f}" for rounds in ranks)
        lines.append(f"| {label} | {calls.get(phase, 0):g} | {cells} |")
    sums = " | ".join(f"{med([sum(r.values()) for r in rounds]):.0f}" for rounds in ranks)
    lines.append(f"| all phases (the instrumented step) | - | {sums} |")
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    world, steps = result["world"], result["step_us"]
    plain, timed = med(steps["gradsync"]), med(steps["gradsync, instrumented"])
    paired = med(
        [t / p for t, p in zip(steps["gradsync, instrumented"], steps["gradsync"], strict=True)]
    )
    parts = [f"## {world} rank{'s' * (world != 1)}", "", "Microseconds per step, medians;"]
    parts[-1] += " in brackets the difference to the module alone's."
    parts += ["", part_table(result), "", phase_table(result), ""]
    in_all, inside = result["wrapper_ns"]
    parts.append(f"The instrumented replica's step: {timed:.0f} us, the plain one's {plain:.0f}")
    parts[-1] += (
        f" us ({paired:.3f}x round by round): the phases are accurate to that. A timed call"
    )
    parts[-1] += f" costs {in_all:.0f} ns more than a plain one, {inside:.0f} ns of it inside"
    parts[-1] += " its phase's clock window (the rest lands in its caller's phase)."
    if result["missing"]:
        parts.append(f"Not found, so not timed: {', '.join(result['missing'])}.")
    if result["profile"]:
        prof = result["profile"]
        parts += ["", f"torch.profiler: {prof['profiled_us']:.0f} us a step profiled, "]
        parts[-1] += f"{prof['plain_us']:.0f} plain. gradsync's ranges per step (rank 0):"
        parts += ["", "| range | calls | us |", "|---|---:|---:|"]
        parts += [f"| {n} | {c:g} | {us:.0f} |" for n, c, us in prof["ranges"]]
    return "\n".join(parts) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--layers", type=int, default=150)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="also 20 steps under torch.profiler")
    p.add_argument("--out", default=None, help="write every rank's numbers as JSON here")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        rank_main(args)
        return
    results = []
    for world in args.worlds:
        argv = [__file__, "--worker", *_forwarded(args)]
        results.append(launch.json_line(launch.on_loopback(argv, world, args.timeout), TAG))
        print(report(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The flags a worker needs, as the command line spells them."""
    out = ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    out += ["--steps-per-round", str(args.steps_per_round), "--layers", str(args.layers)]
    out += ["--width", str(args.width), "--batch", str(args.batch)]
    return out + (["--profile"] if args.profile else [])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
