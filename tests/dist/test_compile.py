"""torch.compile on a gradsync wrapper, in both orders, side by side with torch DDP.

One spawn of 2 gloo ranks trains the same small MLP four ways: ``torch.compile(wrapper)``
("outer") and ``wrapper(torch.compile(module))`` ("inner"), each for gradsync and for torch's
``DistributedDataParallel``, with gradient accumulation through ``no_sync()`` and through
``require_backward_grad_sync = False`` (nanoGPT's way). Each case records dynamo's graph breaks
and graphs, how DDPOptimizer split the graph, when the buckets were launched during the
compiled backward, and the trained parameters. See docs/compile.md.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.testing.dynamo import ddp_optimizer_pieces
from gradsync.testing.spawn import spawn

WORLD, STEPS, ACCUM, BATCH = 2, 3, 2, 4  # BATCH: samples per rank and micro-batch
WIDTH = 512  # two 1 MiB layers: with 1 MiB buckets DDPOptimizer splits the graph in three
CASES = [(w, o) for o in ("outer", "inner") for w in ("torch", "gradsync")]
TOL = 2e-6  # float32 summation-order noise


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(WORLD * BATCH, 16, generator=g), torch.randn(WORLD * BATCH, 4, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...], rank: int | None) -> torch.Tensor:
    x, y = (t if rank is None else t[rank * BATCH : (rank + 1) * BATCH] for t in batch)
    return F.mse_loss(model(x), y) / ACCUM


def _reference() -> dict[str, torch.Tensor]:
    """One process, no compile: every micro-batch is both ranks' samples concatenated."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for micro in range(ACCUM):
            _loss(model, _global_batch(step, micro), None).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _watch_backward(loss: torch.Tensor, events: list[str]) -> None:
    """Log ``compute`` when each compiled graph's backward starts (one node per graph)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            node.register_prehook(lambda *_: events.append("compute"))
        todo.extend(next_node for next_node, _ in node.next_functions)


def _watch_launches(ddp: nn.Module, events: list[str]) -> None:
    """Log ``launch`` when a bucket's reduction starts."""
    if isinstance(ddp, gradsync.DistributedDataParallel):
        hook = ddp.reducer.comm_hook
        start = hook.start
        hook.start = lambda bucket: (events.append("launch"), start(bucket))[1]  # type: ignore[method-assign]
    else:

        def allreduce(state, bucket):  # type: ignore[no-untyped-def]  # (torch reads annotations)
            events.append("launch")
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, allreduce)


def _train(rank: int, which: str, order: str) -> dict:
    dynamo.reset()
    counters.clear()
    module = _model()
    wrap = gradsync.DistributedDataParallel if which == "gradsync" else TorchDDP
    ddp = wrap(torch.compile(module, backend="aot_eager") if order == "inner" else module,
               bucket_cap_mb=1)  # fmt: skip
    model = torch.compile(ddp, backend="aot_eager") if order == "outer" else ddp
    events: list[str] = []
    _watch_launches(ddp, events)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(STEPS):
        for micro in range(ACCUM):
            sync = micro == ACCUM - 1
            if step % 2 == 0:  # accumulate under no_sync() ...
                ctx = contextlib.nullcontext() if sync else ddp.no_sync()
            else:  # ... or with the flag, as nanoGPT does
                ddp.require_backward_grad_sync = sync
                ctx = contextlib.nullcontext()
            with ctx:
                loss = _loss(model, _global_batch(step, micro), rank)
            del events[:]
            _watch_backward(loss, events)
            loss.backward()
        opt.step()
        opt.zero_grad()
    last_compute = len(events) - events[::-1].index("compute") if "compute" in events else 0
    return {
        "breaks": sum(counters["graph_break"].values()),
        "reasons": list(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "events": events,  # of the last backward
        "launched_early": events[:last_compute].count("launch"),
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


def _all_cases(rank: int, world: int) -> dict:
    out = {}
    with ddp_optimizer_pieces() as splits:
        for which, order in CASES:
            del splits[:]
            out[which, order] = _train(rank, which, order)
            out[which, order]["splits"] = list(splits)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    # Fresh processes, not the pool: dynamo and inductor keep process-wide caches, counters
    # and compile workers that a later case in the same process would inherit.
    return spawn(_all_cases, WORLD, timeout_s=240, fresh=True)


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_no_more_graph_breaks_than_torch_ddp_and_one_graph(cases: list[dict], order: str) -> None:
    for out in cases:
        mine, torchs = out["gradsync", order], out["torch", order]
        assert mine["breaks"] <= torchs["breaks"], (mine["reasons"], torchs["reasons"])
        assert mine["graphs"] == torchs["graphs"] == 1, (mine["reasons"], torchs["reasons"])
        # the breaks left are torch DDP's own: entering torch's _inside_ddp_forward()
        assert all("_inside_ddp_forward" in r for r in mine["reasons"]), mine["reasons"]


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_ddp_optimizer_splits_the_graph_and_reductions_overlap_backward(
    cases: list[dict], order: str
) -> None:
    for out in cases:
        mine, torchs = out["gradsync", order], out["torch", order]
        # DDPOptimizer split the module's graph at the same bucket boundaries as for torch DDP
        assert mine["splits"] == torchs["splits"] and mine["splits"][0] == 3, (mine, torchs)
        # one compiled backward per piece, and buckets launched while earlier pieces still
        # had to run their backward: communication overlaps the compiled backward
        assert mine["events"].count("compute") == 3, mine["events"]
        assert mine["launched_early"] >= 1 and torchs["launched_early"] >= 1, (mine, torchs)


@pytest.mark.parametrize("order", ["outer", "inner"])
def test_compiled_training_equals_one_process_on_the_full_batch(
    cases: list[dict], order: str
) -> None:
    reference = _reference()
    for out in cases:
        for which in ("gradsync", "torch"):
            params = out[which, order]["params"]
            diff = max((params[n] - reference[n]).abs().max().item() for n in reference)
            assert diff < TOL, (which, order, diff)
