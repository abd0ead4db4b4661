"""Under ``Recovery`` every rank runs every step, and collectives of different steps never pair up.

Three ranks run the docs' loop (``docs/recovery.md``) over a dataset whose epochs end in a step
of 2 samples: the third rank has no share there, gets a micro-batch of no sample from
``step.micro_batches``, and takes part in the step; the job must end equal to one process on
the concatenated global batches (float64, 1e-12), with no rank reported lost and no warning
(the sampler, built before the wrapper, sees that it reduces by ``item_mean``). Then one rank
skips a step by hand, and every rank must raise ``DesyncError`` naming it and both steps,
where the step's first collective is the gradient reduction (the step tags carry the loop's
number of the step) and where it is ``step.all_reduce``; where it is a checkpoint's save, its
gathers carry their step in their name, and every rank raises ``ProtocolError`` naming both.
In the deterministic mode a step that leaves a rank no leaf is refused on every rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_behaviour import error_text
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.recovery import Recovery
from gradsync.testing.spawn import spawn

WORLD, GLOBAL, EPOCHS = 3, 6, 2
SAMPLES = 3 * GLOBAL + 2  # each epoch: global batches of 6, 6, 6 and 2
STEPS = EPOCHS * 4


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, 5, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)).repeat(1, 2))


def _model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 2)).double()


def _optimizer(params) -> tuple[torch.optim.Optimizer, object]:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))


def _setup(leaves: bool = False):  # type: ignore[no-untyped-def]
    data = _data()
    sampler = GlobalBatchSampler(
        data, GLOBAL, micro_batch_size=1 if leaves else None, seed=2, deterministic=leaves
    )
    loader = DataLoader(data, batch_sampler=sampler)
    model = gradsync.DistributedDataParallel(
        _model(),
        reduction="item_mean",
        timeout=10.0,
        deterministic=sampler.leaves_per_step if leaves else None,
    )
    opt, scheduler = _optimizer(model.parameters())
    recovery = Recovery(model, opt, sampler, lr_scheduler=scheduler)
    return loader, model, opt, scheduler, recovery


def _docs_loop(rank: int, world: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train_as_the_docs(rank)
    return {**result, "warnings": [str(w.message) for w in caught]}


def _train_as_the_docs(rank: int) -> dict:
    loader, model, opt, scheduler, recovery = _setup()
    sizes: dict[int, list[int]] = {}
    for step in recovery.steps(STEPS):  # the loop of docs/recovery.md, as it is written there
        with step:
            micro = list(step.micro_batches(loader))
            for i, (x, y) in enumerate(micro):
                model.require_backward_grad_sync = i == len(micro) - 1
                loss = F.mse_loss(model(x), y) * len(x)
                model.count_items(len(x))
                loss.backward()
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
        sizes[step.number] = [len(x) for x, _ in micro]
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"params": params, "events": recovery.events, "sizes": sizes}


def _reference() -> dict[str, torch.Tensor]:
    data, model = _data(), _model()
    opt, scheduler = _optimizer(model.parameters())
    sampler = GlobalBatchSampler(data, GLOBAL, num_replicas=1, rank=0, seed=2)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices in sampler:
            x, y = data[indices]
            F.mse_loss(model(x), y).backward()
            opt.step()
            scheduler.step()
            opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_rank_with_no_sample_in_a_step_takes_part_and_the_job_equals_one_process() -> None:
    results = spawn(_docs_loop, WORLD, timeout_s=90)
    reference = _reference()
    for rank, result in enumerate(results):
        assert result["events"] == [], (rank, result["events"])  # nobody reported lost
        # Uneven shares, but item_mean: the sampler, built before the wrapper, says nothing.
        assert not result["warnings"], (rank, result["warnings"])
        for name, p in result["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=name)
    # The short steps (3 and 7): 2 samples for 3 ranks, the last rank's batch has none.
    assert [r["sizes"][3] for r in results] == [[1], [1], [0]]
    assert [r["sizes"][7] for r in results] == [[1], [1], [0]]


def _skip_a_step(rank: int, collective: str, folder: str) -> None:
    """Rank 2 skips the body of step 2; the others run it. The body's first collective is the
    gradient reduction, ``step.all_reduce`` or a checkpoint's save (``collective``)."""
    loader, model, opt, _, recovery = _setup()
    ckpt = Checkpointer(f"{folder}/{collective}", model=model, optimizer=opt)
    for step in recovery.steps(STEPS):
        with step:
            if rank == 2 and step.number == 2:
                continue  # noqa: B012 (the rest of this step's body, skipped on purpose)
            if collective == "all_reduce":
                step.all_reduce(torch.ones(2, dtype=torch.float64))
            if collective == "save":
                ckpt.save(step.number)
            for x, y in step.micro_batches(loader):
                loss = F.mse_loss(model(x), y, reduction="sum")
                model.count_items(len(x))
                loss.backward()
            opt.step()
            opt.zero_grad()


def _leafless() -> None:
    """The deterministic mode, a leaf per sample: the short step's 2 leaves, for 3 ranks."""
    loader, model, opt, _, recovery = _setup(leaves=True)
    for step in recovery.steps(STEPS):
        with step:
            micro = list(step.micro_batches(loader))
            for i, (x, y) in enumerate(micro):
                model.require_backward_grad_sync = i == len(micro) - 1
                loss = F.mse_loss(model(x), y, reduction="sum")
                model.count_items(len(x))
                loss.backward()
            opt.step()
            opt.zero_grad()


def _skips(rank: int, world: int, folder: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {"leafless": error_text(_leafless)}
    dist.barrier()
    for collective in ("gradients", "all_reduce", "save"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uneven shares: item_mean is exact anyway
            out[collective] = error_text(lambda c=collective: _skip_a_step(rank, c, folder))
        dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_rank_a_step_behind_or_ahead_raises_a_named_error_on_every_rank(tmp_path) -> None:
    results = spawn(_skips, WORLD, (str(tmp_path),), timeout_s=90)
    where = {"gradients": "this step would sum gradients", "all_reduce": "step.all_reduce would"}
    for collective in ("gradients", "all_reduce"):
        for rank, out in enumerate(results):
            text = out[collective]
            assert text is not None and text.startswith("DesyncError"), (collective, rank, text)
            assert where[collective] in text, (collective, rank, text)  # at the step's first
            assert "rank(s) [0, 1]: the loop's step 2" in text, (collective, rank, text)
            assert "rank(s) [2]: the loop's step 3" in text, (collective, rank, text)
            assert "skipped a whole step" in text, (collective, rank, text)
    for rank, out in enumerate(results):  # refused on every rank, before any collective
        text = out["leafless"]
        assert text is not None and text.startswith("UsageError: gradsync: step 3 "), (rank, text)
        assert "2 leaves" in text and "3 ranks" in text and "drop_last=True" in text, text
    for rank, out in enumerate(results):  # a save's gathers carry their step in their name
        text = out["save"]
        assert text is not None and text.startswith("ProtocolError"), (rank, text)
        assert "rank 0 at the check before saving step 2;" in text, (rank, text)
        assert "rank 2 at the check before saving step 3)" in text, (rank, text)
