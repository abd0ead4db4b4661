"""ZeRO-1 in the deterministic mode: the same bits at any world size, optimizer state included.

A GPT whose parameter sizes cut badly (an embedding of 24: slices split parameters at every
offset) trains with ``shard_optimizer(AdamW)``, clipped by ``opt.clip_grad_norm_`` every step,
in several buckets, on 10 leaves per step at N = 1, 2, 3 and 4. Every parameter on every rank,
every optimizer-state tensor (consolidated: every rank's slices gathered full) and every step's
clipping norm must be ``torch.equal`` to one process training the same leaves with a
replicated ``torch.optim.AdamW`` and the same clipping: ZeRO-1 changes no bit. The same across a
``Checkpointer`` resume from 4 ranks to 3 mid-run, and for a short last step inside
``join(opt)`` that leaves a rank without a leaf. (A fused CPU optimizer, whose slices get other
bits, is refused: ``test_deterministic.py``'s refusals.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.optim import ShardedOptimizer
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.leaf_steps import train_leaf_steps
from gradsync.testing.spawn import spawn

SEQS, BLOCK, LEAF, GLOBAL = 160, 8, 2, 20  # 10 leaves of 2 sequences per step
STEPS, MOVED_AT = 12, 5
CFG = GPTConfig(vocab_size=61, block_size=BLOCK, n_layer=2, n_head=2, n_embd=24)
CAP_MB = 12_000 / 2**20  # a few buckets of ~3,000 parameters
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}
MAX_NORM = 0.3  # below every step's norm here: the clip scales every step


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (SEQS, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _setup(sharded: bool, **kwargs: Any) -> tuple[nn.Module, Any, Any, GlobalBatchSampler]:
    sampler = GlobalBatchSampler(range(SEQS), GLOBAL, LEAF, seed=1, deterministic=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    ddp = gradsync.DistributedDataParallel(
        model,
        reduction="item_mean",
        deterministic=sampler.leaves_per_step,
        bucket_cap_mb=CAP_MB,
        **kwargs,
    )
    if sharded:
        opt: Any = ddp.shard_optimizer(torch.optim.AdamW, **ADAMW)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
    return model, ddp, opt, sampler


def _clip(opt: Any, ddp: Any) -> torch.Tensor:
    """The sharded optimizer's clip; the replicated run's: gradsync's on the full gradients."""
    if isinstance(opt, ShardedOptimizer):
        return opt.clip_grad_norm_(MAX_NORM)
    return gradsync.optim.clip_grad_norm_(ddp.parameters(), MAX_NORM)


def _result(model: nn.Module, opt: Any, norms: list[torch.Tensor]) -> dict[str, Any]:
    """Every parameter, and on rank 0 every optimizer-state tensor by parameter name (a sharded
    optimizer's gathered full from every rank's slices)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(opt, ShardedOptimizer):
        opt.consolidate_state_dict(to=0)
        full = opt.state_dict() if dist.get_rank() == 0 else None
    else:
        full = opt.state_dict()
    state = {}
    if full is not None:
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        state = {order[i]: entry for i, entry in full["state"].items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "state": state, "norms": [float(n) for n in norms]}


def _run(rank: int, world: int, sharded: bool) -> dict[str, Any]:
    model, ddp, opt, sampler = _setup(sharded)
    return _result(
        model,
        opt,
        train_leaf_steps(ddp, opt, sampler, _data(), STEPS, before_step=lambda: _clip(opt, ddp)),
    )


def _moved(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """ZeRO-1 at 4 ranks until ``MOVED_AT``, saved; then loaded at 3 and trained on."""
    model, ddp, opt, sampler = _setup(sharded=True)
    ckpt = Checkpointer(root, model=ddp, optimizer=opt, sampler=sampler, timeout=60)
    if phase == "first":
        norms = train_leaf_steps(
            ddp, opt, sampler, _data(), MOVED_AT, before_step=lambda: _clip(opt, ddp)
        )
        ckpt.save(MOVED_AT)
        return {"norms": [float(n) for n in norms]}
    assert ckpt.load() == MOVED_AT
    return _result(
        model,
        opt,
        train_leaf_steps(ddp, opt, sampler, _data(), STEPS, before_step=lambda: _clip(opt, ddp)),
    )


def _differences(got: dict[str, Any], want: dict[str, Any], state: bool) -> list[str]:
    """What differs from ``want`` by a single bit: parameters, norms and (``state``) every
    optimizer-state tensor."""
    out = [f"param {n}" for n, v in want["params"].items() if not torch.equal(got["params"][n], v)]
    if got["norms"] != want["norms"]:
        out.append("clipping norms")
    if state:
        assert got["state"].keys() == want["state"].keys()
        for name, entry in want["state"].items():
            for key, value in entry.items():
                theirs = torch.as_tensor(got["state"][name][key])
                if not torch.equal(theirs, torch.as_tensor(value)):
                    out.append(f"state {name}.{key}")
    return out


@pytest.fixture(scope="module")
def replicated() -> dict[str, Any]:
    """One process, a replicated AdamW: the bits every ZeRO-1 run must have."""
    want = spawn(_run, 1, (False,))[0]
    assert min(want["norms"]) > MAX_NORM, want["norms"]  # the clip scales every step
    assert len(want["state"]) == len(want["params"])
    return want


@pytest.mark.timeout(300)
def test_zero1_adamw_with_clipping_is_the_same_bits_at_1_2_3_and_4_ranks(
    replicated: dict[str, Any],
) -> None:
    for world in (1, 2, 3, 4):
        for rank, got in enumerate(spawn(_run, world, (True,))):
            diff = _differences(got, replicated, state=rank == 0)
            assert diff == [], (world, rank, diff)


@pytest.mark.timeout(300)
def test_zero1_resumed_from_4_ranks_at_3_ends_with_the_same_bits(
    replicated: dict[str, Any], tmp_path: Path
) -> None:
    first = spawn(_moved, 4, (str(tmp_path), "first"))
    assert first[0]["norms"] == replicated["norms"][:MOVED_AT]
    for rank, got in enumerate(spawn(_moved, 3, (str(tmp_path), "second"))):
        got["norms"] = first[rank]["norms"] + got["norms"]
        diff = _differences(got, replicated, state=rank == 0)
        assert diff == [], (rank, diff)


def _join_epoch(ddp: Any, opt: Any, clip: bool) -> None:
    """One epoch of 54 sequences (steps of 10, 10 and 7 leaves) inside ``join(opt)``: at 4
    ranks the last rank holds no leaf of the short step and steps its slices with the others
    there; ``clip``: every step clipped, the short one too."""
    sampler = GlobalBatchSampler(range(54), GLOBAL, LEAF, seed=1, deterministic=True)
    loader = DataLoader(_data(), batch_sampler=sampler)
    with ddp.join(opt):
        for (x, y), last in sampler.mark_step_ends(loader):
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(x)
                ddp.count_items(y.numel())
                lm_loss(logits, y, reduction="sum").backward()
            if last:
                if clip:
                    opt.clip_grad_norm_(MAX_NORM)
                opt.step()
                opt.zero_grad(set_to_none=True)


def _clipped_short_step(rank: int, world: int) -> str:
    """The short step, clipped: rank 3 has no leaf there and would step its slices unclipped
    (in either mode)."""
    _, ddp, opt, _ = _setup(True, timeout=5.0)
    try:
        _join_epoch(ddp, opt, clip=True)
    except gradsync.GradsyncError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained on"


@pytest.mark.timeout(120)
def test_a_clip_in_a_join_step_where_a_rank_ran_out_is_refused_not_silent() -> None:
    said = spawn(_clipped_short_step, 4, timeout_s=90)
    for rank in range(3):
        assert said[rank].startswith("UsageError") and "1 rank(s) ran out of data" in said[rank]
    assert said[3].startswith("CollectiveTimeoutError") and "ran out of data" in said[3], said[3]


def _short_last_step(rank: int, world: int, sharded: bool) -> dict[str, Any]:
    """The join's epoch, unclipped: a join round repeats only the step (docs/deterministic.md)."""
    model, ddp, opt, _ = _setup(sharded)
    _join_epoch(ddp, opt, clip=False)
    return _result(model, opt, [])


@pytest.mark.timeout(300)
def test_zero1_in_a_join_with_a_short_last_step_is_the_same_bits() -> None:
    want = spawn(_short_last_step, 1, (False,))[0]
    for rank, got in enumerate(spawn(_short_last_step, 4, (True,))):
        diff = _differences(got, want, state=rank == 0)
        assert diff == [], (rank, diff)
