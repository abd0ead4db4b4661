"""ZeRO-1 inside the wrapper (``model.shard_optimizer``): the all-reduce path's gradients in
``.grad``, a sharded step, the parameters all-gathered before ``step()`` returns; equal to one
process, with the bytes of the all-reduce path plus one all-gather of the parameters.
(torch's idioms under it, against one process: ``test_torch_contracts.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.testing import mesh_run
from gradsync.testing.gpt import GPTConfig, lm_loss
from gradsync.testing.mesh_run import Layout
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8)
BATCH, STEPS = 12, 4
DTYPE = torch.float64
SMALL_CAP_MB = 600 / 2**20
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
SGD = {"lr": 0.1, "momentum": 0.9}
# (name, optimizer class, options, bucket cap, reduction, micro-batches)
CASES = [
    ("adamw", torch.optim.AdamW, ADAMW, SMALL_CAP_MB, "mean", 1),
    ("sgd_no_sync", torch.optim.SGD, SGD, None, "mean", 2),
    ("adamw_item_mean", torch.optim.AdamW, ADAMW, 0, "item_mean", 1),
]


def batches(masked: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mesh_run.random_batches(CFG, BATCH, STEPS, masked=masked, seed=900)


class _Bytes:
    """Bytes handed to each kind of collective, patched in for one step."""

    KINDS = ("all_reduce", "reduce_scatter_single", "all_gather_single")

    def __init__(self) -> None:
        self.sent = dict.fromkeys(self.KINDS, 0)
        self.real = {k: getattr(dist, k) for k in self.KINDS}

    def __enter__(self) -> _Bytes:
        for kind in self.KINDS:
            setattr(dist, kind, self._counting(kind))
        return self

    def __exit__(self, *exc: object) -> None:
        for kind, fn in self.real.items():
            setattr(dist, kind, fn)

    def _counting(self, kind: str) -> Any:
        real = self.real[kind]

        def count(*args: Any, **kwargs: Any) -> Any:
            # all_reduce(tensor); reduce_scatter_single(out, in); all_gather_single(out, in)
            t = args[1] if kind == "reduce_scatter_single" else args[0]
            self.sent[kind] += t.numel() * t.element_size()
            return real(*args, **kwargs)

        return count

    def wire(self, world: int) -> float:
        """Bytes each rank sends by a ring: an all-reduce moves 2(d-1)/d of its tensor, a
        reduce-scatter (of its input) and an all-gather (of its output) (d-1)/d each."""
        f = (world - 1) / world
        s = self.sent
        return 2 * f * s["all_reduce"] + f * (s["reduce_scatter_single"] + s["all_gather_single"])


def _wrap(mesh: Any, cap: float | None, reduction: str, seed: int) -> Any:
    model = mesh_run.make_model(CFG, mesh, seed=seed, dtype=DTYPE)
    return gradsync.DistributedDataParallel(
        model, device_mesh=mesh_run.data_parallel_mesh(mesh), bucket_cap_mb=cap,
        reduction=reduction, timeout=60,
    )  # fmt: skip


def _params(ddp: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ddp.state_dict().items()}  # waits for the gathers


def _train_case(mesh: Any, case: tuple) -> dict[str, Any]:
    name, cls, options, cap, reduction, micro = case
    index = mesh_run.data_parallel_index(mesh)
    ddp = _wrap(mesh, cap, reduction, seed=17 * index)  # the wrapper broadcasts rank 0's
    opt = ddp.shard_optimizer(cls, **options)
    data = batches(masked=reduction == "item_mean")
    mesh_run.train(ddp, opt, data[:1], mesh, reduction=reduction, micro_batches=micro)
    grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    stats = opt._attached.gather.stats  # the ring's own count of the bytes it sent (gloo)
    before = stats.bytes_sent
    with _Bytes() as native:
        mesh_run.train(ddp, opt, data[1:2], mesh, reduction=reduction, micro_batches=micro)
    gathered = stats.bytes_sent - before
    sharded_wire = gathered + native.wire(dist.get_world_size(ddp.process_group))
    mesh_run.train(ddp, opt, data[2:], mesh, reduction=reduction, micro_batches=micro)
    plain = _wrap(mesh, cap, reduction, seed=0)
    plain_opt = cls(plain.parameters(), **options)
    with _Bytes() as allreduce:
        mesh_run.train(plain, plain_opt, data[:1], mesh, reduction=reduction, micro_batches=micro)
    state = sum(t.numel() for s in opt.optim.state.values() for t in s.values() if t.dim())
    return {
        "params": _params(ddp),
        # The unsharded wrapper's reduced gradients, bit for bit (the same all-reduces).
        "grads_as_unsharded": all(
            torch.equal(p.grad, grads[n]) for n, p in plain.module.named_parameters()
        ),
        "gathered": gathered,
        "padded_numel": sum(b.layout.padded_numel for b in opt.buckets),
        "state_elements": state,
        "full_state_elements": sum(p.numel() for p in ddp.parameters()),
        "wire": (sharded_wire, allreduce.wire(dist.get_world_size(ddp.process_group))),
        "padding": sum(b.layout.padded_numel - b.layout.numel for b in opt.buckets),
    }


def _clipped(mesh: Any, sharded: bool, clip: str) -> dict[str, torch.Tensor]:
    """SGD with clipping to a norm the gradients exceed, sharded or plain, by ``clip``:
    "opt" (``opt.clip_grad_norm_``) or "torch" (``torch.nn.utils.clip_grad_norm_`` on the
    wrapper's parameters: the reduced ``.grad``)."""
    ddp = _wrap(mesh, SMALL_CAP_MB, "mean", seed=0)
    opt = ddp.shard_optimizer(torch.optim.SGD, **SGD) if sharded else None
    opt = opt or torch.optim.SGD(ddp.parameters(), **SGD)
    for batch in batches(masked=False):
        tokens, targets = mesh_run.rank_part(batch, mesh)
        opt.zero_grad()
        lm_loss(ddp(tokens), targets).backward()
        if clip == "opt":
            opt.clip_grad_norm_(0.05)
        else:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        opt.step()
    return _params(ddp)


def _resumed(mesh: Any, folder: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train 2 steps, save with the Checkpointer (sync, then async), train 2 more; then a fresh
    wrapper and sharded optimizer load the checkpoint and train the same 2 steps."""
    from gradsync.checkpoint import Checkpointer

    data = batches(masked=False)
    runs = []
    for resume in (False, True):
        ddp = _wrap(mesh, SMALL_CAP_MB, "mean", seed=0 if not resume else 5)
        opt = ddp.shard_optimizer(torch.optim.AdamW, **ADAMW)
        ckpt = Checkpointer(folder, model=ddp, optimizer=opt, timeout=60)
        if resume:
            assert ckpt.load() == 2
        else:
            mesh_run.train(ddp, opt, data[:1], mesh)
            ckpt.async_save(1)
            mesh_run.train(ddp, opt, data[1:2], mesh)
            ckpt.wait()
            ckpt.save(2)
        mesh_run.train(ddp, opt, data[2:], mesh)
        runs.append(_params(ddp))
    return runs[0], runs[1]


def _run(rank: int, world: int, layout: Layout, folder: str | None) -> dict[str, Any]:
    mesh = layout.build_mesh()
    out: dict[str, Any] = {case[0]: _train_case(mesh, case) for case in CASES}
    out["clip_sharded"] = _clipped(mesh, sharded=True, clip="opt")
    out["clip_sharded_torch"] = _clipped(mesh, sharded=True, clip="torch")
    out["clip_plain"] = _clipped(mesh, sharded=False, clip="torch")
    if folder is not None:
        out["resume"] = _resumed(mesh, folder)
    return out


# Float64: the reduce-scatter sums each element over the same ranks as the all-reduce, so the
# only differences from one process are the order of sums (observed ~1e-16); AdamW can amplify
# that where a second moment is tiny, hence the margin. A missed reduction or a stale
# parameter moves values by ~1e-3.
TOL = 1e-12


# World sizes 1-4 of the optimizer itself run in test_sharded_optimizer.py; here the wrapper's
# path, on a flat group and on a (dp, cp) mesh.
@pytest.mark.parametrize("name", ["dp2", "dp2_cp2"])
@pytest.mark.timeout(300)
def test_sharded_optimizer_in_the_wrapper_equals_one_process(name: str, tmp_path: Any) -> None:
    layout = {"dp2": Layout(dp=2), "dp2_cp2": Layout(dp=2, cp=2)}[name]
    folder = str(tmp_path / "ckpt") if name == "dp2" else None
    results = spawn(_run, layout.world_size, (layout, folder), timeout_s=280)
    for result in results if folder else ():
        # Resumed from the checkpoint: bit-identical to the run that never stopped.
        uninterrupted, resumed = result["resume"]
        assert all(torch.equal(resumed[n], v) for n, v in uninterrupted.items())
    d = layout.dp * layout.cp
    for name_, cls, options, _, reduction, _ in CASES:
        want = mesh_run.train_reference(
            CFG, lambda ps, c=cls, o=options: c(ps, **o), batches(reduction == "item_mean"),
            seed=0, dtype=DTYPE, reduction=reduction,
        )  # fmt: skip
        for rank, result in enumerate(results):
            got = result[name_]
            diff = max((got["params"][n] - want[n]).abs().max().item() for n in want)
            assert diff < TOL, (name_, rank, diff)
            assert got["grads_as_unsharded"], "a sharded backward must leave the reduced .grad"
            # Each rank holds ~1/d of the state (within one alignment unit per bucket).
            per_param = 2 if cls is torch.optim.AdamW else 1
            full = per_param * got["full_state_elements"]
            assert got["state_elements"] <= full / d + per_param * got["padding"], got
            # The all-reduce path's bytes, plus the all-gather of the (padded) parameters,
            # (d-1)/d of them, through gradsync's ring, which counts every byte it sends, plus
            # the step check's all-reduce of 3 int64: at most 1.5x the all-reduce path.
            sharded, allreduce = got["wire"]
            f = (d - 1) / d
            assert got["gathered"] == f * 8 * got["padded_numel"], got
            assert abs(sharded - (allreduce + got["gathered"] + 2 * f * 24)) < 1e-6, got["wire"]
            assert sharded <= 1.5 * allreduce + 2 * 8 * got["padding"], got["wire"]
    for rank, result in enumerate(results):
        for sharded in ("clip_sharded", "clip_sharded_torch"):
            diff = max(
                (result[sharded][n] - result["clip_plain"][n]).abs().max().item()
                for n in result["clip_plain"]
            )
            assert diff < TOL, (sharded, rank, diff)
    # Every rank ends with the same parameters, bit for bit.
    for result in results[1:]:
        for case in [c[0] for c in CASES]:
            assert all(
                torch.equal(result[case]["params"][n], v)
                for n, v in results[0][case]["params"].items()
            )
