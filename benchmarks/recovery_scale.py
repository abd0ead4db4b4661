"""How in-process recovery grows with the world size: one rank lost inside backward, N ranks.

    python benchmarks/recovery_scale.py [--sizes 4 8 16 32] [--runs 3]

Each rank is a process (forked from one server that imported torch), gloo on loopback, the
job's store a TCPStore hosted by rank 0's process (as torchrun's with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); a tiny float64 model under ``Recovery`` with the
default settings; the last rank SIGKILLs itself inside backward of step 2
(``gradsync.testing.lose_a_rank``). Per N, medians over ``--runs`` runs:

- kill -> next completed step (rank 0), and its phases from rank 0's ``Lost`` record: noticed
  (kill -> the step raised), roll call (-> the membership read), regroup (-> new groups and
  wrapper), redo (-> the redone step completed);
- the store operations a survivor spent in the roll call and in the regroup (every call of
  the survivor's main thread, torch's group set-up included; median and largest over the
  survivors), the keys and bytes they carried, gradsync's own operations apart from torch's
  group set-up, and the background operations per second (the heartbeat) a rank spends
  while nothing fails;
- whether the survivors' parameters equal one process trained on the same global batches.

Also the store's own throughput on this machine (one client, round trips per second).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync.testing.lose_a_rank import lose_a_rank, reference
from gradsync.testing.spawn import RankFailure, spawn

STEPS, AT_STEP = 5, 2


def store_throughput(seconds: float = 1.0) -> dict[str, float]:
    """Round trips per second of one client of a TCPStore on 127.0.0.1, per operation."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    client.set("k", "x" * 64)
    keys = [f"h{i}" for i in range(1024)]
    client.multi_set(keys, ["1" * 8] * len(keys))  # type: ignore[attr-defined]
    ops = {
        "add": lambda: client.add("n", 1),
        "get (64 B)": lambda: client.get("k"),
        "check": lambda: client.check(["k"]),
        "multi_get of 1024 keys": lambda: client.multi_get(keys),
    }
    out = {}
    for name, op in ops.items():
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            op()
            n += 1
        out[name] = n / (time.perf_counter() - t0)
    return out


def one_run(world: int) -> dict[str, Any] | None:
    results = spawn(
        lose_a_rank,
        world,
        (world - 1, AT_STEP, STEPS, {}),
        fresh=True,
        return_failures=True,
        timeout_s=600,
        pg_timeout_s=120,
    )
    survivors = results[:-1]
    failed = [r for r in survivors if isinstance(r, RankFailure) or "events" not in r]
    if failed or not isinstance(results[-1], RankFailure):
        print(f"  N={world}: a survivor failed or the victim lived: {failed[:1]}")
        return None
    ref = reference(world, STEPS)
    exact = all(
        torch.allclose(r["params"][n], ref[n], rtol=0, atol=1e-12) for r in survivors for n in ref
    )
    r0 = survivors[0]
    event = r0["events"][0]
    first = min(t for _, gen, t in r0["done"] if gen == 1)
    out: dict[str, Any] = {
        "noticed": event["noticed"] - r0["signalled"],
        "roll call": event["agreed"] - event["noticed"],
        "regroup": event["regrouped"] - event["agreed"],
        "redo": first - event["regrouped"],
        "kill -> next step": first - r0["signalled"],
        "a step before the loss": r0["done"][1][2] - r0["done"][0][2],
        "exact": exact,
        "heartbeat ops/s": statistics.median(r["background_ops_per_s"] for r in survivors),
    }
    for phase in ("roll call", "regroup"):
        for what in ("ops", "keys", "bytes"):
            values = [r["ops"][phase][what] for r in survivors]
            out[f"{phase} {what}"] = (statistics.median(values), max(values))
        values = [r["gradsync_ops"][phase]["ops"] for r in survivors]
        out[f"{phase} ops, gradsync's own"] = (statistics.median(values), max(values))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    print("store throughput (one client, 127.0.0.1), operations per second:")
    for name, rate in store_throughput().items():
        print(f"  {name:28s} {rate:10.0f}")
    for world in args.sizes:
        runs = [r for r in (one_run(world) for _ in range(args.runs)) if r is not None]
        if not runs:
            continue
        print(f"\nN = {world} ({len(runs)} runs; seconds, medians; ops: median / largest)")
        for key in runs[0]:
            values = [r[key] for r in runs]
            if key == "exact":
                print(f"  {'equal to one process':34s} {all(values)}")
            elif isinstance(values[0], tuple):
                med = statistics.median(v[0] for v in values)
                top = max(v[1] for v in values)
                print(f"  store {key:28s} {med:10.0f} / {top:.0f}")
            else:
                print(f"  {key:34s} {statistics.median(values):10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
