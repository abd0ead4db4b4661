"""The deterministic mode's exchange: its two transports give the same bits, and a step on a CPU
takes no new memory.

On a CPU a bucket's tree is exchanged in point-to-point messages on a worker thread; elsewhere
(NCCL) by ``all_to_all_single`` and ``all_gather_into_tensor`` ([Note: the tree's exchange on a
CPU] in ``comm/tree_messages.py``). The second is forced here on gloo, so that both run: at 3
ranks, 16 leaves a step (blocks of 4, 6 and 6 leaves: 1, 2 and 2 pieces) and a bucket per
parameter, both end with the bits of one process. And from the second step on, every bucket's
buffer, every receive buffer and every second piece's buffer is the memory of the step before:
new memory costs a CPU a page fault per 4 KiB (the bench's step took 2,850 more, an 11.7 MB
bucket's worth, when it was not).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.comm.tree import leaf_range
from gradsync.comm.tree_exchange import TreeExchange
from gradsync.testing.spawn import spawn

LEAVES, STEPS = 16, 4


def _model() -> nn.Module:
    # Parameters of 128 KiB: buckets that hand their buffer over to .grad (buckets.py).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128))


def _train(rank: int, world: int, messages: bool) -> dict[str, Any]:
    """``STEPS`` steps of ``LEAVES`` leaves; the parameters, and the storage of every bucket's
    buffer and receive buffer after each step."""
    by_messages = TreeExchange.__dict__["_by_messages"]  # the staticmethod itself
    if not messages:  # the pooled worker process runs other cases next: put it back
        TreeExchange._by_messages = staticmethod(lambda buffer: False)  # type: ignore[method-assign]
    try:
        model = _model()
        ddp = gradsync.DistributedDataParallel(
            model, reduction="sum", bucket_cap_mb=0, deterministic=LEAVES
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(3)
        memory = []
        for _ in range(STEPS):
            x = torch.randn(LEAVES, 4, 128, generator=g)
            mine = leaf_range(LEAVES, world, rank)
            for i in mine:
                with contextlib.nullcontext() if i == mine[-1] else ddp.no_sync():
                    ddp(x[i]).square().sum().backward()
            opt.step()
            memory.append(_storages(ddp))
            opt.zero_grad(set_to_none=True)  # the buffers' views go: their memory is free
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"params": params, "memory": memory, "buckets": len(ddp.reducer.buckets)}
    finally:
        TreeExchange._by_messages = by_messages  # type: ignore[method-assign]


def _storages(ddp: Any) -> list[int]:
    """Where the buffers of the buckets that hand theirs over to ``.grad`` (of the weights;
    a bias's is copied out), every receive buffer and every second piece's buffer lie."""
    buckets = [b for b in ddp.reducer.buckets if b.hands_over]
    grads = [b.params[0].grad.untyped_storage().data_ptr() for b in buckets]
    exchange = ddp.reducer.comm_hook
    spares = [t for b in ddp.reducer.buckets for t in b.spares]
    kept = [*exchange.messages.received.values(), *spares]
    return grads + [t.untyped_storage().data_ptr() for t in kept]


@pytest.mark.timeout(300)
def test_the_messages_and_the_collectives_are_the_same_bits_as_one_process() -> None:
    one = spawn(_train, 1, (True,))[0]
    for messages in (True, False):
        for rank, got in enumerate(spawn(_train, 3, (messages,))):
            assert got["buckets"] == 4, got["buckets"]  # a weight or a bias per bucket
            differ = [
                k for k in one["params"] if not torch.equal(got["params"][k], one["params"][k])
            ]
            assert differ == [], (messages, rank, differ)


@pytest.mark.timeout(300)
def test_a_step_on_a_cpu_takes_no_new_memory() -> None:
    for rank, got in enumerate(spawn(_train, 3, (True,))):
        memory = got["memory"]
        # two weights' buckets, four receive buffers and, where a rank holds two pieces (ranks
        # 1 and 2), four second pieces' buffers
        assert len(memory[1]) == 2 + 4 + (4 if rank else 0), memory[1]
        assert all(m == memory[1] for m in memory[2:]), (rank, memory)
