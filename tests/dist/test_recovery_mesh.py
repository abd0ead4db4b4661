"""A device mesh under ``Recovery``: a lost replica does not end the job, a lost shard does.

The float64 GPT of the mesh tests, tensor-parallel (torch's ``parallelize_module``) or
context-parallel, trains with AdamW, a decaying learning rate and ``item_mean`` over masked
tokens, inside ``Recovery``, from a ``GlobalBatchSampler`` split over the data-parallel
replicas. Every rank of one replica dies by SIGKILL at once, as a node loss takes them: the
survivors go on at one replica fewer in the same processes, their mesh laid out again in place
(the DTensor parameters, their optimizer state and the tensor-parallel hooks keep working), and
end equal to one process on the same global batches (1e-12), every sample of a step used once.

On dp 3 x tp 2 the first replica dies after the step's commit, where rank 2 reports a failure
as a rank whose commit failed would: the others stepped (its tensor-parallel peer goes on to
wait for it in the next forward, until rank 2's groups close), so it steps from the gradients
it holds. The second replica dies inside backward: no rank had stepped, and the step is
redone. In the deterministic mode the same run ends with the bits of dp 1 x tp 2; in the
default mode the survivors' checkpoint resumes a dp 2 x tp 2 job equal to one process. On
dp 2 x cp 2 a replica dies inside backward. On dp 2 x tp 2 a single tensor-parallel rank dies:
its shard is nowhere else, and every survivor takes the restart path, naming the ranks. Fresh
processes: a rank that kills itself is the point.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext

import pytest
import torch
from test_recovery import _optimizer  # AdamW and a decaying learning rate, as there
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.errors import CollectiveTimeoutError
from gradsync.recovery import NoRecoveryError, Recovery
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.mesh_run import Layout
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import RankFailure, spawn

pytestmark = pytest.mark.filterwarnings("ignore:global batches of")  # item_mean: exact anyway

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
STEPS, GLOBAL_BATCH, MICRO = 6, 6, 1
DTYPE = torch.float64


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH * STEPS, CFG.block_size), generator=g)
    targets = torch.randint(0, CFG.vocab_size, tokens.shape, generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.4] = -1  # uneven valid tokens per chunk
    return TensorDataset(tokens, targets)


def _train(
    rank: int,
    world: int,
    layout: Layout,
    deaths: dict,
    split: tuple | None,
    leaves: bool = False,
    folder: str | None = None,
) -> dict:
    """``deaths``: original rank -> (step, where); ``split``: (ranks, step) that fail after
    the step's commit without stepping, as ranks whose commit raised where others' completed;
    ``folder``: a ``Checkpointer``'s, loaded first and saved to after step 3."""
    mesh = layout.build_mesh()
    model = mesh_run.make_model(CFG, mesh, seed=0, dtype=DTYPE)
    ddp = gradsync.DistributedDataParallel(
        model,
        device_mesh=mesh["dp"] if layout.cp == 1 else mesh["dp", "cp"],
        reduction="item_mean",
        timeout=10,
        deterministic=GLOBAL_BATCH // MICRO if leaves else None,
    )
    opt, sched = _optimizer(ddp.parameters())
    data = _data()
    sampler = GlobalBatchSampler(
        data, GLOBAL_BATCH, MICRO, shuffle=True, seed=5, deterministic=leaves,
        num_replicas=layout.dp, rank=mesh["dp"].get_local_rank(),
    )  # fmt: skip
    ckpt = loaded = None
    if folder is not None:
        ckpt = Checkpointer(folder, model=ddp, optimizer=opt, lr_scheduler=sched, sampler=sampler)
        loaded = ckpt.load()
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched, checkpointer=ckpt, window=3.0)
    death, armed, failed = deaths.get(rank), [False], [False]

    def die_if(where: str) -> None:
        if armed[0] and death[1] == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def fail_after_commit(*_: object) -> None:
        if split and rank in split[0] and recovery.completed == split[1] and not failed[0]:
            time.sleep(1.0)  # the dying replica is gone, the other survivors have stepped
            failed[0] = True
            raise CollectiveTimeoutError("step's commit lost a peer here")

    model.tok_emb.weight.register_hook(lambda g: die_if("backward") or g)  # comes last
    opt.register_step_pre_hook(lambda *_: die_if("optimizer"))  # after Recovery's commit
    opt.register_step_pre_hook(fail_after_commit)
    loader = DataLoader(data)
    used: dict[int, tuple[int, list[int]]] = {}
    for step in recovery.steps(STEPS):
        with step:
            armed[0] = death is not None and step.number == death[0]
            batches = list(step.micro_batches(loader))
            for i, batch in enumerate(batches):
                tokens, targets = mesh_run.rank_part(batch, mesh, rows=False)
                with ddp.no_sync() if i < len(batches) - 1 else nullcontext():
                    logits = ddp(tokens)
                    ddp.count_items(int((targets != -1).sum()))
                    lm_loss(logits, targets, "sum").backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            if ckpt is not None and step.number == 3:
                ckpt.save(step.number + 1)
            shares = sampler.micro_batches_of(step.index)
            used[step.number] = (mesh["dp"].get_local_rank(), [i for s in shares for i in s])
    return {"params": full_parameters(model), "used": used, "events": recovery.events,
            "world": recovery.membership.world_size, "dp": mesh["dp"].size(),
            "loaded": loaded}  # fmt: skip


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG).to(DTYPE)
    opt, sched = _optimizer(model.parameters())
    data = _data()
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, num_replicas=1, rank=0, shuffle=True, seed=5)
    for step, indices in enumerate(sampler):
        if step == STEPS:
            break
        tokens, targets = data[indices]
        (lm_loss(model(tokens), targets, "sum") / (targets != -1).sum()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _check(results: list, deaths: dict, dp_left: int, since: int | None = None) -> list[int]:
    survivors = [r for r in range(len(results)) if r not in deaths]
    for rank in deaths:
        assert isinstance(results[rank], RankFailure), (rank, results[rank])
    reference = _reference()
    batches = list(GlobalBatchSampler(_data(), GLOBAL_BATCH, num_replicas=1, rank=0, seed=5))
    for r in survivors:
        result = results[r]
        assert not isinstance(result, RankFailure), result
        assert (result["world"], result["dp"]) == (len(survivors), dp_left)
        for name, p in result["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=name)
    # from the last loss (or ``since``) on, every step's global batch is used once, split over
    # the replicas
    if since is None:
        since = results[survivors[0]]["events"][-1]["step"]
    for step in range(since, STEPS):
        by_replica = {results[r]["used"][step][0]: results[r]["used"][step][1] for r in survivors}
        got = sorted(i for idx in by_replica.values() for i in idx)
        assert len(by_replica) == dp_left and got == sorted(batches[step]), step
    return survivors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deterministic", [False, True])
def test_dp_tp_loses_whole_replicas_and_ends_equal_to_one_process(
    deterministic: bool,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    # dp 3 x tp 2: replica 2 (ranks 4, 5) dies after step 1's commit, where rank 2 fails
    # without stepping and the others step (rank 3, its tensor-parallel peer, goes on to wait
    # for it in step 2's forward); replica 0 dies in backward at step 3
    deaths = {4: (1, "optimizer"), 5: (1, "optimizer"), 0: (3, "backward"), 1: (3, "backward")}
    folder = None if deterministic else str(tmp_path)
    args = (Layout(dp=3, tp=2), deaths, ((2,), 1), deterministic, folder)
    results = spawn(_train, 6, args, fresh=True, return_failures=True, timeout_s=200)
    survivors = _check(results, deaths, dp_left=1)
    for r in survivors:
        events = results[r]["events"]
        assert [(e["lost"], e["world_size"], e["step"]) for e in events] == [
            ([4, 5], 4, 1),
            ([0, 1], 2, 3),
        ], events
    if folder is not None:  # the survivors' save after step 3 resumes a dp 2 x tp 2 job
        resumed = spawn(_train, 4, (Layout(dp=2, tp=2), {}, None, False, folder), fresh=True,
                        timeout_s=100)  # fmt: skip
        assert [r["loaded"] for r in resumed] == [4] * 4
        _check(resumed, {}, dp_left=2, since=4)
    if deterministic:  # the bits of dp 1 x tp 2 throughout, at dp 3, then 2, then 1
        alone = spawn(_train, 2, (Layout(dp=1, tp=2), {}, None, True), fresh=True, timeout_s=100)
        for r in survivors:
            for name, p in results[r]["params"].items():
                assert torch.equal(p, alone[r - 2]["params"][name]), (r, name)


@pytest.mark.timeout(180)
def test_dp_cp_loses_a_whole_replica_and_ends_equal_to_one_process() -> None:
    deaths = {2: (2, "backward"), 3: (2, "backward")}
    results = spawn(_train, 4, (Layout(dp=2, cp=2), deaths, None), fresh=True,
                    return_failures=True, timeout_s=150)  # fmt: skip
    _check(results, deaths, dp_left=1)


@pytest.mark.timeout(180)
def test_losing_part_of_a_replica_takes_the_restart_path_saying_why() -> None:
    deaths = {3: (2, "backward")}
    results = spawn(_train, 4, (Layout(dp=2, tp=2), deaths, None), fresh=True,
                    return_failures=True, timeout_s=150)  # fmt: skip
    for r in (0, 1, 2):
        failure = results[r]
        assert isinstance(failure, RankFailure), failure
        assert failure.exc_type == NoRecoveryError.__name__, failure
        assert "lost rank(s) [3] of replica dp=1 (ranks [2, 3]) but not rank(s) [2]" in (
            failure.message
        ), failure.message
