"""``gradsync bench``: step time, its compute/communication split and bus bandwidth, in one run.

    gradsync bench                                  # simulated 2 nodes at 1 Gbit/s, then loopback
    gradsync bench --where loopback --rounds 3      # no root needed
    gradsync bench --rate-mbit 500 --out runs/bench-500
    gradsync bench --trace --out runs/trace        # a profiler trace per rank, in seconds
    gradsync bench --where host                     # host-bound: 300 tiny tensors, 1, 2, 4 ranks

(``python -m gradsync bench`` takes the same flags.) Both settings run two ranks, one thread
each, and the same worker (:mod:`gradsync.bench.worker`): on a
:class:`~gradsync.testing.cluster.SimulatedCluster` of 2 nodes x 1 rank under torchrun, where every
byte crosses a shaped link, and on loopback through :func:`gradsync.testing.spawn.spawn`, where
the link is nearly free and compute dominates. They run one after the other: both share this
machine's CPUs.

Writes ``results.json`` (every timing), ``report.md`` (the tables, also printed) and two plots
to ``--out``. The default model (12.7M parameters, 50.7 MB of float32 gradients) and link rate
(1000 Mbit/s) are chosen so that, on a 2-vCPU machine, compute (~0.35 s) and communication
(~0.45 s, ring bound 0.42 s) are within 2x of each other: that is where overlap matters and
where bucketing choices show.

``--where host`` times another model: one whose step is nearly all host work, the proxy for a
GPU waiting on its host, at 1, 2 and 4 loopback ranks (:mod:`gradsync.bench.hostbound`); it
writes ``results.json`` and ``report.md`` and needs no matplotlib.

``--trace`` measures nothing: it profiles a few steps on loopback and writes one
Chrome/Perfetto trace per rank with gradsync's ranges in it (:mod:`gradsync.bench.trace`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from gradsync.bench import host_report, hostbound, report, trace
from gradsync.bench.plots import plot_breakdown, plot_step_vs_bucket
from gradsync.bench.worker import add_model_arguments

DESCRIPTION = """\
Time one training step of gradsync (its default, bucket caps 0, 1, 5, 25, 100 MB, one bucket
and 'auto'), torch's DistributedDataParallel and average_gradients, next to compute alone and
communication alone, on 2 simulated nodes (network namespaces, links shaped to --rate-mbit;
needs root) and on loopback; then all-reduce bus bandwidth against the ring bound. --formats
adds the wire formats (gradsync bf16 and PowerSGD rank 4, torch DDP with bf16_compress_hook and
powerSGD_hook) with bytes per step. Writes report.md, results.json and two plots to --out. A
default run takes ~3 minutes on 2 vCPUs (--rounds sets the length). --trace instead profiles
a few steps on loopback and writes one Chrome/Perfetto trace per rank (open them at
https://ui.perfetto.dev), with a table of gradsync's ranges (copy-in, launch, wait, checks,
write-back) per rank.

--where host times a host-bound step instead, the proxy for a GPU waiting on its host: 150
Linear(8, 8) layers (300 parameter tensors, tiny compute), so that the step is the host's work
per parameter and per bucket. torch DDP, gradsync's default (step timeline on), gradsync with
straggler_every=0 and the module alone run side by side, interleaved round by round, at 1, 2
and 4 loopback gloo ranks (--worlds); the report gives gradsync / torch DDP and the timeline's
cost against the targets (<= 1.00x, <= 1.01x). About two minutes on 2 vCPUs.
"""

T = TypeVar("T")
NODES = 2  # a ring over 2 nodes: every byte crosses the shaped link once in each direction
ROUNDS = 5  # timed rounds of the GPT settings when --rounds is not given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``gradsync bench`` (the model and round flags are forwarded to the worker)."""
    parser.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    parser.add_argument(
        "--where",
        choices=["both", "cluster", "loopback", "host"],
        default="both",
        help="settings to measure (default both; 'both' falls back to loopback alone where a "
        "simulated cluster cannot be built, e.g. without root); 'host': the host-bound model "
        "on loopback at --worlds ranks, instead of the GPT",
    )
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=1000.0,
        help="simulated link rate per direction, Mbit/s (default 1000)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="hard limit per setting (default 900)"
    )
    trace.add_arguments(parser)
    add_model_arguments(parser, rounds=None)
    hostbound.add_arguments(parser)


# What the report needs beyond gradsync's own dependencies, checked before minutes of
# measurement, not after them: a run that dies drawing its plots has lost all its numbers.
OPTIONAL = {"matplotlib": "pip install 'gradsync[bench]'"}


def missing_optional() -> str | None:
    """The message for the first optional dependency the report needs that is not installed."""
    for module, install in OPTIONAL.items():
        if importlib.util.find_spec(module) is None:
            return f"gradsync bench: its plots need {module}, which is not installed: {install}"
    return None


def run(args: argparse.Namespace) -> int:
    """Measure every requested setting, then write the JSON, report and plots; 0 on success."""
    from gradsync.testing.cluster import SimulatedCluster

    if args.trace:  # no plots, so no matplotlib needed
        return trace.run(args)
    if args.where == "host":  # no plots either
        return _run_host(args)
    missing = missing_optional()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    if args.rounds is None:
        args.rounds = ROUNDS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = ["cluster", "loopback"] if args.where == "both" else [args.where]
    if "cluster" in settings:
        ok, reason = SimulatedCluster.available()
        if not ok:
            if args.where == "cluster":
                print(f"gradsync bench: no simulated cluster here: {reason}", file=sys.stderr)
                return 2
            print(f"gradsync bench: skipping the simulated cluster: {reason}", file=sys.stderr)
            settings.remove("cluster")
    results = []
    for setting in settings:
        t0 = time.perf_counter()
        # The load average says how much of the machine other work took during the run: on a
        # shared 2-vCPU host it is the first thing to read next to the numbers.
        load_before = os.getloadavg()[0]
        result = _run_cluster(args, out) if setting == "cluster" else _run_loopback(args, out)
        if result is None:
            return 1
        result["loadavg_1min"] = [load_before, os.getloadavg()[0]]
        result["wall_s"] = time.perf_counter() - t0
        print(f"{result['label']}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        results.append(result)
    with open(out / "results.json", "w") as f:
        json.dump(results, f, indent=1)
    plots = ["step_vs_bucket.png", "breakdown.png"]
    plot_step_vs_bucket(results, str(out / plots[0]))
    plot_breakdown(results, str(out / plots[1]))
    text = report.markdown_report(results, plots)
    (out / "report.md").write_text(text)
    print(text)
    print(f"gradsync bench: wrote {out / 'report.md'}, {out / 'results.json'} and the plots")
    return 0


def _worker_flags(args: argparse.Namespace) -> list[str]:
    """The model and round flags, as the worker's command line spells them."""
    flags = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    flags += ["--n-head", str(args.n_head), "--vocab-size", str(args.vocab_size)]
    flags += ["--block-size", str(args.block_size), "--batch-per-rank", str(args.batch_per_rank)]
    flags += ["--warmup", str(args.warmup), "--rounds", str(args.rounds), "--caps", *args.caps]
    flags += ["--busbw-sizes-mib", *map(str, args.busbw_sizes_mib)]
    flags += ["--busbw-iters", str(args.busbw_iters), "--busbw-warmup", str(args.busbw_warmup)]
    return flags + (["--formats"] if args.formats else [])


def _run_cluster(args: argparse.Namespace, out: Path) -> dict[str, Any] | None:
    """2 simulated nodes x 1 rank under torchrun; the worker writes JSON from rank 0."""
    from gradsync.testing.cluster import SimulatedCluster

    label = f"simulated {NODES} nodes x 1 rank, {args.rate_mbit:g} Mbit/s"
    json_path = out / "cluster.json"
    json_path.unlink(missing_ok=True)
    progress = out / "cluster.progress"
    # The worker is a rank program run by torchrun (not a user entry point).
    argv = ["-m", "gradsync.bench.worker", "--out", str(json_path.resolve())]
    argv += ["--progress", str(progress.resolve()), "--timeout-s", str(args.timeout_s)]
    argv += _worker_flags(args)
    with SimulatedCluster(NODES, rate_mbit=args.rate_mbit) as cluster:
        results = _follow(
            label,
            progress,
            lambda: cluster.launch(
                argv,
                nproc_per_node=1,
                timeout_s=args.timeout_s,
                extra_env={"OMP_NUM_THREADS": "1"},  # never oversubscribe (cluster pitfall 3)
            ),
        )
    if not all(r.ok for r in results) or not json_path.exists():
        for r in results:
            print(r.summary(), file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(json_path.read_text())
    result.update(label=label, setting="cluster", rate_mbit=args.rate_mbit, nodes=NODES)
    return result


def _run_loopback(args: argparse.Namespace, out: Path) -> dict[str, Any] | None:
    """2 ranks on loopback through :func:`gradsync.testing.spawn.spawn` (file store, no ports)."""
    from gradsync.bench.worker import spawn_rank
    from gradsync.errors import SpawnError
    from gradsync.testing.spawn import spawn

    label = "loopback, 2 ranks"
    progress = out / "loopback.progress"
    wargs = argparse.Namespace(**vars(args))
    wargs.progress = str(progress.resolve())
    try:
        ranks = _follow(
            label,
            progress,
            lambda: spawn(
                spawn_rank,
                2,
                (wargs,),
                pg_timeout_s=min(args.timeout_s, 300.0),
                timeout_s=args.timeout_s,
            ),
        )
    except SpawnError as exc:
        print(f"gradsync bench: loopback run failed: {exc}", file=sys.stderr)
        return None
    result: dict[str, Any] = ranks[0]
    result.update(label=label, setting="loopback", rate_mbit=None, nodes=1)
    return result


def _run_host(args: argparse.Namespace) -> int:
    """The host-bound model at each of ``--worlds`` on loopback, one world size after the
    other; then the JSON and the report."""
    from gradsync.errors import SpawnError
    from gradsync.testing.spawn import spawn

    if min(args.worlds) < 1 or args.steps_per_round < 1 or args.host_layers < 1:
        print(
            "gradsync bench: --worlds, --steps-per-round and --host-layers take 1 or more",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for world in args.worlds:
        label = f"host-bound, {world} rank{'s' * (world != 1)}"
        progress = out / f"host-{world}.progress"
        cfg = hostbound.config(args, str(progress.resolve()))
        t0, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            ranks = _follow(
                label,
                progress,
                partial(
                    spawn,
                    hostbound.host_rank,
                    world,
                    (cfg,),
                    pg_timeout_s=min(args.timeout_s, 300.0),
                    timeout_s=args.timeout_s,
                ),
            )
        except SpawnError as exc:
            print(f"gradsync bench: {label} failed: {exc}", file=sys.stderr)
            return 1
        result: dict[str, Any] = ranks[0]
        result.update(label=label, setting="host", loadavg_1min=[load_before, os.getloadavg()[0]])
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
    with open(out / "results.json", "w") as f:
        json.dump(results, f, indent=1)
    text = host_report.markdown_report(results)
    (out / "report.md").write_text(text)
    print(text)
    print(f"gradsync bench: wrote {out / 'report.md'} and {out / 'results.json'}")
    return 0


def _follow(label: str, progress: Path, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread while a progress bar follows the lines rank 0 appends."""
    progress.unlink(missing_ok=True)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="gradsync-bench", daemon=True)
    thread.start()
    with tqdm(desc=label, unit="phase", dynamic_ncols=True) as bar:
        while thread.is_alive():
            thread.join(timeout=0.5)
            _update(bar, progress)
        _update(bar, progress)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _update(bar: tqdm, progress: Path) -> None:
    """Move the bar to rank 0's last progress line (redraw only on news: logs stay short)."""
    try:
        lines = progress.read_text().splitlines()
    except FileNotFoundError:
        return
    if not lines:
        return
    done, total, what = lines[-1].split(" ", 2)
    if bar.n == int(done) and bar.total == int(total):
        return
    bar.total = int(total)
    bar.n = int(done)
    bar.set_postfix_str(what, refresh=False)
    bar.refresh()
