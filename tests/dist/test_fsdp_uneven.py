"""FSDP2 with gradsync across, on uneven data: an epoch whose last global batch has fewer
samples than there are data-parallel ranks equals one process.

FSDP2's collectives run inside every forward and backward, so a rank with no sample cannot
leave the step to the others (torch's ``Join`` does not cover ``fully_shard`` either): with
``GlobalBatchSampler.mark_step_ends`` every rank runs every step, and a rank whose share of the
short last step is empty runs a micro-batch of no sample, adding exact zeros and counting no
item. 19 sequences in global batches of 8 on replicate2 x shard2: steps of 8, 8 and 3 samples,
the last leaving rank 3 nothing; AdamW, ``item_mean``, two epochs; one spawn of 4 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsync.data import GlobalBatchSampler
from gradsync.testing import fsdp_run
from gradsync.testing.fsdp_run import FSDPLayout
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
SEQS, GLOBAL, MICRO, EPOCHS = 19, 8, 2, 2


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab_size, (SEQS, CFG.block_size + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _run(rank: int, world: int) -> dict[str, Any]:
    mesh = FSDPLayout(replicate=2, shard=2).build_mesh()
    model = fsdp_run.make_model(CFG, mesh, torch.float64)
    sync = fsdp_run.parallelize(model, mesh, "item_mean", timeout=20)
    opt = _optimizer(model.parameters())
    sampler = GlobalBatchSampler(_data(), GLOBAL, MICRO)  # over every data-parallel rank
    loader = DataLoader(_data(), batch_sampler=sampler)
    empty = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for (x, y), last in sampler.mark_step_ends(loader):
            empty += len(x) == 0
            model.set_requires_gradient_sync(last)
            sync.count_items(y.numel())
            lm_loss(model(x), y, "sum").backward()
            if last:
                opt.step()
                opt.zero_grad()
    return {"params": full_parameters(model), "empty": empty}


def _reference() -> dict[str, torch.Tensor]:
    """One process, each global batch whole."""
    torch.manual_seed(0)
    model = GPT(CFG).to(torch.float64)
    opt = _optimizer(model.parameters())
    data = _data()
    sampler = GlobalBatchSampler(data, GLOBAL, num_replicas=1, rank=0)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices in sampler:
            x, y = data[indices]
            (lm_loss(model(x), y, "sum") / y.numel()).backward()
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_short_last_step_that_leaves_a_rank_no_sample_equals_one_process() -> None:
    results = spawn(_run, 4, timeout_s=90)
    assert [r["empty"] for r in results] == [0, 0, 0, EPOCHS]  # rank 3: once an epoch
    reference = _reference()
    for rank, result in enumerate(results):
        for name, p in result["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=(rank, name))
