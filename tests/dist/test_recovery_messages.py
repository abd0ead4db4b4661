"""What the survivors say when global rank 0, the job's store's host, is lost.

As under torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the job's store is a TCP store
served by global rank 0's process (on 127.0.0.1), and the others reach it through
``MASTER_ADDR``/``MASTER_PORT``. Rank 0 kills itself in a step: each survivor must end with
``NoRecoveryError`` and log one line saying that the store lived in global rank 0's process
and that the restart path takes over, not only the store client's own words. Fresh
processes: a rank kills itself, and the environment is set per process.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.recovery import NoRecoveryError, Recovery
from gradsync.testing.log_lines import LogLines
from gradsync.testing.spawn import RankFailure, spawn


def _store_host_lost(rank: int, world: int) -> dict:
    # The job's store in rank 0's process, as torchrun's workers reach it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, group_src=0)
    os.environ.update(
        TORCHELASTIC_RUN_ID="store-host-lost",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port[0]),
    )
    lines = LogLines()
    logging.getLogger("gradsync.recovery").addHandler(lines)
    x = torch.randn(24, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(1, keepdim=True))
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(
        nn.Linear(4, 1).double(), reduction="item_mean", timeout=10.0
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recovery = Recovery(model, opt, GlobalBatchSampler(data, 6), window=1.0)
    loader = DataLoader(data)
    try:
        for step in recovery.steps(4):
            with step:
                if rank == 0 and step.number == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                for xs, ys in step.micro_batches(loader):
                    loss = ((model(xs) - ys) ** 2).sum()
                    model.count_items(len(xs))
                    loss.backward()
                opt.step()
                opt.zero_grad()
    except NoRecoveryError as exc:
        return {"error": str(exc), "lines": lines.lines, "address": recovery.store_address}
    return {"error": None, "lines": lines.lines}


@pytest.mark.timeout(120)
def test_losing_the_stores_host_says_where_the_store_lived_and_what_happens_next() -> None:
    results = spawn(_store_host_lost, 3, fresh=True, return_failures=True, timeout_s=90)
    assert isinstance(results[0], RankFailure)
    for rank in (1, 2):
        result = results[rank]
        error = result["error"]
        assert error is not None, (rank, result)
        assert f"the job's store at {result['address']} cannot be reached" in error, error
        assert "it lived in global rank 0's process, lost with it" in error, error
        assert "torchrun's restart (--max-restarts) takes over" in error, error
        [line] = [ln for ln in result["lines"] if "cannot recover in-process" in ln]
        assert f"rank {rank} cannot recover in-process at step 2" in line, line
        assert "it lived in global rank 0's process" in line, line
        assert line.endswith("exiting so that the job restarts from its last checkpoint"), line
