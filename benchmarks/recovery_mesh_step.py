"""What ``Recovery`` costs per step on a dp x tp mesh while nothing fails: the step's commit.

    python benchmarks/recovery_mesh_step.py [--rounds 8] [--dp 2] [--tp 2]

On a dp x tp mesh every optimizer step under ``Recovery`` begins with a commit, one small
all-reduce over every rank ([Note: a mesh under Recovery] in ``recovery/replicas.py``). The GPT
of the bench (2 layers x 256, float32, AdamW, tensor-parallel attention and MLP over ``tp``)
trains on ``dp x tp`` local gloo ranks, by a plain loop and by the same loop under
``Recovery``, in alternating rounds of 8 steps; medians of the slowest rank's step, and their
ratio round by round. The commit is also timed alone (the same call, outside a step), beside
a plain ``all_reduce`` of one float.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from recovery_time import alternate, print_ratios, slowest  # the same alternating rounds

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.recovery import Recovery
from gradsync.recovery.collectives import stamped_barrier
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPTConfig, lm_loss
from gradsync.testing.mesh_run import Layout
from gradsync.testing.spawn import spawn

CONFIG = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=256)
GLOBAL_BATCH = 8


def _per_step(rank: int, world: int, layout: Layout, rounds: int) -> dict:
    torch.set_num_threads(1)
    mesh = layout.build_mesh()
    model = mesh_run.make_model(CONFIG, mesh, seed=0, dtype=torch.float32)
    ddp = gradsync.DistributedDataParallel(model, device_mesh=mesh["dp"], reduction="item_mean")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (GLOBAL_BATCH * 16 * (rounds + 2), 65), generator=g
    )
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    replica = mesh["dp"].get_local_rank()
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, num_replicas=layout.dp, rank=replica)
    recovery = Recovery(ddp, opt, sampler)

    def body(indices: list[list[int]]) -> None:
        for idx in indices:
            x, y = data[idx]
            loss = lm_loss(ddp(x), y, "sum")
            ddp.count_items(y.numel())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = alternate(body, sampler, recovery, rounds)
    commits, plain_all_reduces = [], []
    for _ in range(50):
        t0 = time.perf_counter()
        stamped_barrier(0, recovery, ddp.options.timeout)
        commits.append(slowest(time.perf_counter() - t0))
        t0 = time.perf_counter()
        dist.all_reduce(torch.zeros(1))
        plain_all_reduces.append(slowest(time.perf_counter() - t0))
    return {
        "times": times,
        "commit": statistics.median(commits),
        "all_reduce": statistics.median(plain_all_reduces),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    layout = Layout(dp=args.dp, tp=args.tp)
    result = spawn(_per_step, layout.world_size, (layout, args.rounds), fresh=True, timeout_s=1800)[
        0
    ]
    print(f"per step, dp {args.dp} x tp {args.tp}, {args.rounds} rounds of 8 steps each")
    print("(medians, slowest rank):")
    print_ratios(result["times"])
    print(f"  the commit alone {result['commit'] * 1e3:8.2f} ms")
    print(f"  a plain all_reduce of one float, beside it {result['all_reduce'] * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
