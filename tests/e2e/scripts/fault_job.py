"""A tiny training job in which rank 1 misbehaves at step 3, as a user's job might.

    torchrun --standalone --nproc-per-node 2 fault_job.py FAULT [--timeout S] [--marker M]

FAULT is one of ``sigstop`` (rank 1 stops itself), ``sigkill`` (rank 1 kills itself),
``exit`` (rank 1 exits with code 3), ``slow`` (rank 1 sleeps far past the deadline), ``eval``
(rank 1 switches to eval mode with BatchNorm while the others train) and ``sigkill-inside``
(rank 1 kills itself while it waits in the step's gradient all-reduce for rank 0, who comes
late, once its arrival record says it got there). The job uses torch's default process-group
timeout (30 minutes), as users' jobs do: only gradsync's ``timeout`` may end it. Rank 0 prints
``ELAPSED <seconds>`` from the fault to its error, and ignores torchrun's SIGTERM so that it is
not killed before it has printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync


def main() -> None:
    parser = argparse.ArgumentParser()
    faults = ("sigstop", "sigkill", "exit", "slow", "eval", "sigkill-inside")
    parser.add_argument("fault", choices=faults)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--marker", default="", help="ignored: lets a test find its processes")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torch's default timeout: 30 minutes
    rank = dist.get_rank()
    if rank == 0:
        # torchrun sends SIGTERM to the survivors as soon as it sees rank 1 die, while rank 0 may
        # still be finding out who died: what the test reads would depend on which comes first.
        # Rank 0 ends by itself once it has said it (it raises); torchrun's SIGKILL follows its
        # grace if it did not.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.manual_seed(0)
    # BatchNorm only where the fault needs it: without buffers, the collective left waiting is
    # a gradient all-reduce (the hardest to walk away from), not a buffer broadcast.
    norm = nn.BatchNorm1d(16) if args.fault == "eval" else nn.Identity()
    model = nn.Sequential(nn.Linear(8, 16), norm, nn.Linear(16, 4))
    ddp = gradsync.DistributedDataParallel(model, timeout=args.timeout)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    t_fault = time.monotonic()
    try:
        for step in range(10):
            if step == 3:
                t_fault = time.monotonic()
                if rank == 1:
                    misbehave(args.fault, ddp)
                elif args.fault == "sigkill-inside":
                    time.sleep(1.5)  # rank 1 waits for rank 0 in the all-reduce, and dies there
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    except gradsync.GradsyncError as exc:
        print(f"RANK {rank} ELAPSED {time.monotonic() - t_fault:.1f}", flush=True)
        print(f"RANK {rank} ERROR {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    print(f"RANK {rank} FINISHED", flush=True)


def misbehave(fault: str, ddp: gradsync.DistributedDataParallel) -> None:
    if fault == "sigstop":
        print(f"RANK 1 STOPS {os.getpid()}", flush=True)  # the test continues it at the end
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "exit":
        os._exit(3)
    elif fault == "slow":
        time.sleep(600)
    elif fault == "eval":
        ddp.eval()
    elif fault == "sigkill-inside":
        # From a thread, half a second after the step's first gradient: rank 1 waits in the
        # all-reduce by then (rank 0 comes a second later), and a wait that long has written
        # its arrival record to the store.
        killer = threading.Timer(0.5, _kill_once_recorded)
        ddp.module[0].weight.register_post_accumulate_grad_hook(lambda _: killer.start())


def _kill_once_recorded() -> None:
    """SIGKILL this rank once its arrival record of the reduction has reached the store.

    A TCPStore ``set`` is not answered, so the record may still be on its way when the process
    dies, and the others would read the previous one ("last seen at step 3 (then it died)"):
    the test's message would depend on which came first. A ``check`` on the same store
    connection is answered after the ``set`` before it, so the kill comes after the record."""
    dist.distributed_c10d._get_default_store().check(["fault_job/after-the-record"])
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
