"""docs/deterministic.md's loop, as the page shows it: checkpoints mid-epoch inside ``join()``
and resumes at another world size with the bits of one process.

54 sequences a epoch: steps of 20, 20 and 14 sequences (10, 10 and 7 leaves of 2), two epochs.
Three ranks train with an LR schedule stepped per step, saving after every step but an epoch's
last, and stop after the save of global step 4 (the middle of the second epoch); two ranks
resume from it and finish. Every
parameter at the end is ``torch.equal`` to one process's, trained through the same loop without
a stop. At three ranks the short last step's 7 leaves leave rank 2 none: it waits in the join,
and a save there is refused on the ranks that ask, at once, saying why.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.errors import ProtocolError
from gradsync.testing.spawn import spawn

LENGTH, GLOBAL, LEAF, EPOCHS, STOP_AT, SAVE_EVERY = 54, 20, 2, 2, 4, 1


def _setup(root: str, deterministic: bool = True) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(LENGTH, 8, generator=g), torch.randint(0, 4, (LENGTH,)))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    sampler = GlobalBatchSampler(dataset, GLOBAL, LEAF, seed=0, deterministic=True)
    leaves = sampler.leaves_per_step if deterministic else None
    model = gradsync.DistributedDataParallel(net, reduction="item_mean", deterministic=leaves)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)  # per step
    ckpt = Checkpointer(
        root, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, keep=None
    )
    return dataset, net, sampler, model, opt, sched, ckpt


def _docs_loop(
    rank: int,
    world: int,
    root: str,
    stop_at: int | None,
    save_short: bool = False,
    deterministic: bool = True,
) -> dict[str, Any]:
    """The page's loop, line for line, but for ``stop_at`` (the job stopped after that save),
    ``save_short`` (a save asked for at the short last step, too) and ``deterministic``."""
    dataset, net, sampler, model, opt, sched, ckpt = _setup(root, deterministic)
    loader = DataLoader(dataset, batch_sampler=sampler)
    ckpt.load()  # None on a fresh start; else the sampler resumes mid-epoch
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        with model.join(opt):
            for (x, y), last in sampler.mark_step_ends(loader):
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(x), y, reduction="sum")
                    model.count_items(len(y))
                    loss.backward()
                if last:
                    opt.step()
                    opt.zero_grad()
                    step = epoch * sampler.steps_per_epoch + sampler.step
                    if sampler.step < sampler.steps_per_epoch:  # not the epoch's last step
                        sched.step()
                        if sampler.step % SAVE_EVERY == 0:
                            ckpt.save(step)
                    elif save_short:
                        ckpt.save(step)
                    if step == stop_at:
                        return {}
        sched.step()  # the epoch's last step's, on every rank once the join ends
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _docs_loop_warned(
    rank: int, world: int, root: str, stop_at: int | None
) -> tuple[dict[str, Any], list[str]]:
    """The loop, and the warnings it gave (a join that was not exact warns at its end)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _docs_loop(rank, world, root, stop_at)
    return out, [str(w.message) for w in caught if "join()" in str(w.message)]


@pytest.mark.timeout(300)
def test_the_docs_loop_saves_mid_epoch_and_resumes_on_2_ranks_with_one_process_bits(
    tmp_path: Path,
) -> None:
    one = spawn(_docs_loop, 1, (str(tmp_path / "one"), None))[0]
    moved = str(tmp_path / "moved")
    # At 3 ranks, rank 2 waits out epoch 0's short last step in the join: the schedule stays
    # in step on every rank, so the join's end finds nothing to warn about.
    for _, warned in spawn(_docs_loop_warned, 3, (moved, STOP_AT)):
        assert warned == [], warned
    saved = sorted(p.name for p in Path(moved).glob("step_*"))
    assert saved == ["step_00000001", "step_00000002", "step_00000004"], saved
    for rank, got in enumerate(spawn(_docs_loop, 2, (moved, None))):
        assert _equal(got, one) == [], (rank, _equal(got, one))


def _save_at_the_short_step(rank: int, world: int, root: str) -> str:
    try:
        _docs_loop(rank, world, root, None, save_short=True)
    except ProtocolError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_save_where_a_rank_ran_out_of_data_is_refused_saying_so(tmp_path: Path) -> None:
    out = spawn(_save_at_the_short_step, 3, (str(tmp_path),), return_failures=True)
    for rank in (0, 1):  # the ranks with leaves in the short step ask for the save
        assert out[rank].startswith("RanksOutOfData: ") and "1 rank(s) ran out" in out[rank]
    assert not isinstance(out[2], str)  # rank 2 waited in the join: its deadline named it


@pytest.mark.timeout(120)
def test_at_one_rank_the_default_mode_gives_other_bits_to_rounding(tmp_path: Path) -> None:
    """As the page says: the default mode adds a step's micro-batches in turn, the deterministic
    mode over its tree; at N = 1 too they are the same training to rounding, not to the bit."""
    tree = spawn(_docs_loop, 1, (str(tmp_path / "tree"), None))[0]
    in_turn = spawn(_docs_loop, 1, (str(tmp_path / "in_turn"), None, False, False))[0]
    assert _equal(tree, in_turn), "the tree and the sum in turn gave the same bits"
    diff = max((tree[k] - in_turn[k]).abs().max().item() for k in tree)
    assert diff < 1e-4, diff
