"""Mixed precision used the ways real training scripts use it, not only the documented loop.

Multi-rank cases run in one 2-rank gloo spawn and are each compared with one process training
on the concatenated batch ([Note: main gradients], ``test_main_grads.py``): the optimizer built
before the model is wrapped on ranks initialised differently, the model loaded after the
optimizer was built, eval forwards with grad enabled between the backward and the step (on
rank 0 alone, on every rank, and eval-mode training), float64 main gradients, clipping with
``opt.clip_grad_norm_``, gradients cleared after the backward (``opt.zero_grad()``,
``model.zero_grad()``, ``opt.zero_grad(set_to_none=False)``), and refused main-gradient dtypes,
clipping of ``.grad`` alone and learning rates that differ across ranks. The
one-process cases (parameter groups, closures, loads that do not fit, outside writes) run in
the test process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_main_grads import (
    MICRO,
    STEPS,
    WORLD,
    batch,
    loss_of,
    make_model,
    reference_grads,
    reference_masters,
)
from torch import nn

import gradsync
from gradsync.errors import ReplicaMismatchError, UsageError
from gradsync.optim import MasterWeights
from gradsync.testing.spawn import spawn

TIMEOUT = 20.0
LR = 1e-2
CLIP = 0.05  # well below these gradients' norm: every step is clipped


def _train(
    rank: int,
    build: str = "wrap first",
    eval_forward: str = "",
    main_grad_dtype: torch.dtype = torch.float32,
    optimizer: str = "AdamW",
    clip: str = "",
    clear: dict[int, str] | None = None,
    lr: float = LR,
) -> list[torch.Tensor]:
    """``STEPS`` steps of ``MICRO`` micro-batches with fp32 master weights; the masters.

    ``build``: "wrap first" (the documented order); "opt first": the optimizer built before
    wrapping, on rank-specific weights that the wrapper's broadcast replaces; "load": built on
    other weights, then the model loaded; "load after a step": the same after one step (SGD:
    no state but the masters). ``clip``: "opt" clips to norm ``CLIP`` with
    ``opt.clip_grad_norm_``, "torch" with ``torch.nn.utils.clip_grad_norm_`` (``.grad``
    only: refused). ``clear``: per step, how the gradients are cleared after the backward
    (:func:`_clear`)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_({"opt first": rank, "load": 1.0, "load after a step": 1.0}.get(build, 0.0))
    if build == "opt first":
        opt = MasterWeights(model.parameters(), getattr(torch.optim, optimizer), lr=lr)
    ddp = gradsync.DistributedDataParallel(model, main_grad_dtype=main_grad_dtype, timeout=TIMEOUT)
    if build != "opt first":
        opt = MasterWeights(model.parameters(), getattr(torch.optim, optimizer), lr=lr)
    if build == "load after a step":
        _window(ddp, 0, rank, eval_forward)
        opt.step()
    if build.startswith("load"):
        ddp.load_state_dict(make_model().state_dict())
    for step in range(STEPS):
        opt.zero_grad()
        _window(ddp, step, rank, eval_forward)
        if eval_forward == "all ranks" or (eval_forward == "rank 0" and rank == 0):
            ddp.eval()  # an evaluation that forgot torch.no_grad()
            ddp(batch(0, 0, 0)[0])
            ddp.train()
        _clear(opt, ddp, (clear or {}).get(step))
        if clip == "opt":
            opt.clip_grad_norm_(CLIP)
        elif clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    ddp.check_replicas()
    return [m.detach().clone() for m in opt.master]


def _window(ddp: nn.Module, step: int, rank: int, eval_forward: str) -> None:
    if eval_forward == "training":  # every micro-batch in eval mode: its backward counts
        ddp.eval()
    for micro in range(MICRO):
        if micro < MICRO - 1:
            with ddp.no_sync():  # type: ignore[operator]
                loss_of(ddp, step, rank, micro).backward()
        else:
            loss_of(ddp, step, rank, micro).backward()
    ddp.train()


def _clear(opt: Any, model: nn.Module, how: str | None) -> None:
    """Clear the gradients after the backward: "opt" ``opt.zero_grad()``, "model"
    ``model.zero_grad()`` (both: nothing to step), "zeros" ``opt.zero_grad(set_to_none=False)``
    (a zero gradient, which AdamW still steps), "model zeros" the same on the model (refused:
    it zeroes ``.grad`` alone, not the ``main_grad`` the step reads)."""
    if how == "opt":
        opt.zero_grad()
    elif how == "model":
        model.zero_grad()
    elif how == "zeros":
        opt.zero_grad(set_to_none=False)
    elif how == "model zeros":
        model.zero_grad(set_to_none=False)


# Of the STEPS = 3 steps the second steps nothing, the third a zero gradient (AdamW's moments
# from the first still move the weights).
CLEARS = {1: "opt", 2: "zeros"}


def _refusals() -> dict[str, str]:
    errors = {}
    for dtype in (torch.float8_e4m3fn, torch.float16):
        try:
            gradsync.DistributedDataParallel(make_model(), main_grad_dtype=dtype, timeout=TIMEOUT)
        except UsageError as exc:
            errors[str(dtype)] = str(exc)
    return errors


CASES: dict[str, dict[str, Any]] = {
    "opt before wrap": {"build": "opt first"},
    "load after opt": {"build": "load"},
    "load after a step": {"build": "load after a step", "optimizer": "SGD"},
    "eval on rank 0": {"eval_forward": "rank 0"},
    "eval on all ranks": {"eval_forward": "all ranks"},
    "eval-mode training": {"eval_forward": "training"},
    "float64 main grads": {"main_grad_dtype": torch.float64},
    "clipped": {"clip": "opt", "optimizer": "SGD"},  # SGD: the clipping moves every update
    "cleared": {"clear": CLEARS},
}


def _run(rank: int, world: int) -> dict[str, Any]:
    """Each case's masters, or the error that ended it (raised on every rank alike, so the
    ranks go on to the next case together)."""
    out: dict[str, Any] = {}
    for case, kwargs in CASES.items():
        try:
            out[case] = _train(rank, **kwargs)
        except ReplicaMismatchError as exc:
            out[case] = str(exc)
    refused = {
        "torch's clip": {"clip": "torch"},
        "model zeroed": {"clear": {0: "model zeros"}},
        "lr on rank 1": {"lr": LR * (1 + rank)},
    }
    for case, kwargs in refused.items():
        try:
            _train(rank, **kwargs)
            out[case] = "no error"
        except UsageError as exc:  # in opt.step(), on every rank alike
            out[case] = str(exc)
    return {"masters": out, "refused": _refusals()}


def _reference_masters(optimizer: str, clip: float = 0.0) -> list[torch.Tensor]:
    """One process: fp32 ``optimizer`` on the mean of every rank's micro-batch gradients."""
    return reference_masters(make_model(), getattr(torch.optim, optimizer), LR, clip)


def _reference_cleared(clear: dict[int, str]) -> list[torch.Tensor]:
    """One process, fp32 AdamW masters, as torch clears: no gradient at the steps cleared to
    ``None`` (the step skips every parameter), a zero gradient at those zeroed."""
    model = make_model()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR)
    for step in range(STEPS):
        grads = reference_grads(model, step)
        for m, g in zip(master, grads, strict=True):
            how = clear.get(step)
            m.grad = None if how in ("opt", "model") else g * 0 if how == "zeros" else g
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master, strict=True):
                p.copy_(m)
    return [m.detach() for m in master]


def test_misused_master_weights_train_as_one_process() -> None:
    results = spawn(_run, WORLD)
    want = {name: _reference_masters(name) for name in ("AdamW", "SGD")}
    want["clipped"] = _reference_masters("SGD", CLIP)
    want["cleared"] = _reference_cleared(CLEARS)
    for rank, out in enumerate(results):
        torch_clip = out["masters"].pop("torch's clip")
        assert torch_clip.startswith("gradsync: MasterWeights: the .grad of parameter #0"), (
            torch_clip
        )
        assert "opt.clip_grad_norm_(max_norm)" in torch_clip, torch_clip
        zeroed = out["masters"].pop("model zeroed")
        assert "model.zero_grad(set_to_none=False)" in zeroed, zeroed
        assert "clear with opt.zero_grad()" in zeroed, zeroed
        lr = out["masters"].pop("lr on rank 1")
        assert lr.startswith("gradsync: MasterWeights.step(): the ranks would step"), lr
        assert "param group 0's 'lr' is 0.01 on rank 0 and 0.02 on rank 1" in lr, lr
        refused = out["refused"]
        assert set(refused) == {"torch.float8_e4m3fn", "torch.float16"}, (rank, refused)
        assert "main_grad_dtype" in refused["torch.float8_e4m3fn"], refused
        assert "narrower than parameter '0.weight'" in refused["torch.float16"], refused
        off = {}
        for case, got in out["masters"].items():
            ref = want.get(case, want[CASES[case].get("optimizer", "AdamW")])
            pairs = zip(got, ref, strict=True) if isinstance(got, list) else None
            off[case] = got if pairs is None else max((g - w).abs().max().item() for g, w in pairs)
        print(f"rank {rank}: largest difference from one process: {off}")
        # As in test_main_grads.py: fp32 reorder noise moves Adam's update ~1e-7.
        assert all(isinstance(d, float) and d <= 1e-5 for d in off.values()), (rank, off)


# -- one process ------------------------------------------------------------------------------
def _fp32_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _fp32_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 2, generator=g))


def test_parameter_groups_and_closures_work_as_in_torch() -> None:
    # An fp32 model: the masters are the parameters' values, so torch's optimizer on a copy
    # of the model must give the same bits.
    ours, theirs = _fp32_model(), _fp32_model()

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": model[0].parameters(), "lr": 1e-1}, {"params": model[2].parameters()}]

    opt = MasterWeights(groups(ours), torch.optim.AdamW, lr=1e-3)
    torch_opt = torch.optim.AdamW(groups(theirs), lr=1e-3)
    assert [g["lr"] for g in opt.param_groups] == [1e-1, 1e-3]
    for step in range(2):
        for model, o in ((ours, opt), (theirs, torch_opt)):
            o.zero_grad()
            _fp32_loss(model, step).backward()
            o.step()
    assert all(
        torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )

    # LBFGS calls the closure several times per step, at moved weights.
    ours, theirs = _fp32_model(), _fp32_model()
    opt = MasterWeights(ours.parameters(), torch.optim.LBFGS, lr=0.5, max_iter=4)
    torch_opt = torch.optim.LBFGS(theirs.parameters(), lr=0.5, max_iter=4)
    for model, o in ((ours, opt), (theirs, torch_opt)):

        def closure(model: nn.Module = model, o: Any = o) -> torch.Tensor:
            o.zero_grad()
            loss = _fp32_loss(model, 0)
            loss.backward()
            return loss

        loss = o.step(closure)
        assert isinstance(loss, torch.Tensor)
    assert all(
        torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )

    model = _fp32_model()
    with pytest.raises(UsageError, match="more than once"):
        MasterWeights(
            [{"params": model.parameters()}, {"params": [model[0].weight]}], torch.optim.SGD
        )
    with pytest.raises(UsageError, match="not a mix"):
        MasterWeights([model[0].weight, {"params": [model[2].weight]}], torch.optim.SGD, lr=0.1)


class _A(nn.Module):
    def __init__(self, b_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
        self.b = nn.Parameter(torch.randn(b_shape, dtype=torch.bfloat16))


def test_loads_that_do_not_fit_are_refused_naming_the_parameter() -> None:
    a, b = _A((4,)), _A((3, 4))
    saved = MasterWeights(a.parameters(), torch.optim.SGD, lr=0.1)
    opt = MasterWeights(b.parameters(), torch.optim.SGD, lr=0.1)
    before = [m.detach().clone() for m in opt.master]
    with pytest.raises(UsageError, match=r"parameter #1 .* shape \(4,\), the parameter \(3, 4\)"):
        opt.load_state_dict(saved.state_dict())  # (4,) would broadcast into (3, 4)
    names = ["w", "b"]
    with pytest.raises(UsageError, match=r"parameter 'b' has shape \(4,\)"):
        opt.load_named_state_dict(saved.named_state_dict(names), names)
    fewer = MasterWeights([b.w], torch.optim.SGD, lr=0.1)
    with pytest.raises(UsageError, match="holds 2 master weights, this optimizer 1"):
        fewer.load_state_dict(saved.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(opt.master, before, strict=True))  # nothing loaded


def _bf16_steps(model: nn.Module, opt: MasterWeights, steps: range) -> None:
    for step in steps:
        for p in model.parameters():
            g = torch.Generator().manual_seed(step)
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()


def test_writes_outside_the_optimizer_win_and_loads_resume_exactly() -> None:
    model = _A((4,))
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-3)
    _bf16_steps(model, opt, range(2))
    state = copy.deepcopy(opt.state_dict())
    _bf16_steps(model, opt, range(2, 4))
    # A load rounds the saved masters into the model: the next step starts from the saved
    # fp32 masters, not from their rounding.
    resumed_model = _A((4,))
    resumed = MasterWeights(resumed_model.parameters(), torch.optim.AdamW, lr=1e-3)
    resumed.load_state_dict(state)
    _bf16_steps(resumed_model, resumed, range(2, 4))
    assert all(torch.equal(x, y) for x, y in zip(opt.master, resumed.master, strict=True))

    # A parameter written in place (a model load, a user's copy_) is the new weight...
    with torch.no_grad():
        model.w.copy_(torch.ones(4, 4))
    sgd = MasterWeights(model.parameters(), torch.optim.SGD, lr=0.0)
    _bf16_steps(model, sgd, range(1))
    with torch.no_grad():
        model.b.copy_(torch.full((4,), 2.0))
    _bf16_steps(model, sgd, range(1))
    assert torch.equal(sgd.master[1], torch.full((4,), 2.0))
    # ...and so is a write through .data before the first step (the wrapper's broadcast).
    sgd = MasterWeights(model.parameters(), torch.optim.SGD, lr=0.0)
    model.w.data.copy_(torch.full((4, 4), 3.0))
    _bf16_steps(model, sgd, range(1))
    assert torch.equal(sgd.master[0], torch.full((4, 4), 3.0))


def test_main_grad_of_any_dtype_is_the_gradient() -> None:
    model = _A((4,))
    opt = MasterWeights(model.parameters(), torch.optim.SGD, lr=1.0)
    start = [m.detach().clone() for m in opt.master]
    mains = [torch.full(p.shape, 1 + 2.0**-12, dtype=torch.float64) for p in model.parameters()]
    for p, main in zip(model.parameters(), mains, strict=True):
        p.main_grad = main  # type: ignore[attr-defined]
        p.grad = main.to(torch.bfloat16)  # 1.0: the rounding loses the 2**-12
    opt.step()
    for m, s, main in zip(opt.master, start, mains, strict=True):
        assert torch.equal(m, s - main.float())


def test_clip_grad_norm_without_main_grad_clips_grad_as_torch() -> None:
    ours, theirs = _fp32_model(), _fp32_model()
    opt = MasterWeights(ours.parameters(), torch.optim.SGD, lr=0.1)
    for model in (ours, theirs):
        _fp32_loss(model, 0).backward()
    norm = opt.clip_grad_norm_(0.1)
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    assert norm > 0.1 and torch.allclose(norm, torch_norm, rtol=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)
