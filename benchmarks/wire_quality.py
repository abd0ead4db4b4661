"""Final loss of the main job with each wire format, over several seeds.

    python benchmarks/wire_quality.py --seeds 0 1 2 --epochs 2 --jobs 4

Runs ``examples/train_gpt.py`` on 2 gloo ranks (torchrun) for every ``--compression`` and seed,
``--jobs`` runs at a time, and prints each run's final loss (its final weights on a fixed set
of sequences) next to the exact run of the same seed, and the spread of the exact runs across
seeds: a format's gap means something only against how far the exact loss moves when nothing
but the seed changes.
A format ``powersgd@K`` runs PowerSGD after K exact steps (``--powersgd-start-iter K``).
Writes every run's loss curve (every 10 steps) to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN_JOB = os.path.join(HERE, "..", "examples", "train_gpt.py")


def run_one(args: argparse.Namespace, fmt: str, seed: int, port: int) -> dict:
    out = os.path.join(args.out, f"{fmt.replace('@', '-')}-seed{seed}")
    os.makedirs(out, exist_ok=True)
    losses = os.path.join(out, "losses.json")
    compression, _, start_iter = fmt.partition("@")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(port), MAIN_JOB, "--compression", compression, "--seed", str(seed),
        "--powersgd-start-iter", start_iter or "0",
        "--epochs", str(args.epochs), "--dtype", args.dtype, "--out", out, "--no-resume",
        "--no-reference", "--save-every", "0", "--losses-out", losses, *args.job_args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:  # keep the others going; the first error lines say why
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln][:5]
        print(f"{fmt} seed {seed} failed:", *errors, sep="\n", file=sys.stderr)
        return {"format": fmt, "seed": seed, "final": float("nan"), "every_10_steps": {}}
    with open(losses) as f:
        return {"format": fmt, "seed": seed, **json.load(f)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["none", "bf16", "powersgd"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (2 processes each)")
    p.add_argument("--out", default="runs/wire-quality")
    p.add_argument("--base-port", type=int, default=29600, help="run i uses base + 7 i")
    args, args.job_args = p.parse_known_args()  # the rest goes to the main job as it is
    grid = [(f, s) for s in args.seeds for f in args.formats]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_one, args, f, s, args.base_port + 7 * i)
            for i, (f, s) in enumerate(grid)
        ]
        results = [fut.result() for fut in futures]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    final = {(r["format"], r["seed"]): r["final"] for r in results}
    print(f"main job, 2 ranks, {args.epochs} epochs, {args.dtype}: final loss")
    print("| format | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean gap vs none |")
    print("|---|" + "---:|" * (len(args.seeds) + 1))
    for fmt in args.formats:
        cells, gaps = [], []
        for s in args.seeds:
            loss, exact = final[(fmt, s)], final.get(("none", s))
            gap = (loss - exact) / exact if exact else float("nan")
            gaps.append(gap)
            cells.append(f"{loss:.4f}" + ("" if fmt == "none" else f" ({gap:+.2%})"))
        print(f"| {fmt} | " + " | ".join(cells) + f" | {statistics.mean(gaps):+.2%} |")
    exact = [final[("none", s)] for s in args.seeds if ("none", s) in final]
    if len(exact) > 1:
        spread = statistics.stdev(exact) / statistics.mean(exact)
        print(f"exact runs across seeds: mean {statistics.mean(exact):.4f}, sd {spread:.2%}")


if __name__ == "__main__":
    main()
