"""gradsync's wrapper inside HF Accelerate, the HF Trainer and Lightning, on 2 gloo ranks.

Each framework trains a tiny randomly initialised model a few optimizer steps with gradient
accumulation (2 micro-batches per step) and gradient clipping, used the way its own docs show,
once with gradsync's integration and once with the framework's stock torch DDP. Both must end
with the parameters of one process trained on the concatenated batches (plain torch, no
framework), to float32 reordering noise. Each run also reports the type of the model the
framework trained and gradsync's count of synchronised backward passes, so a run that fell back
to torch DDP (or reduced every micro-batch) fails.

One spawn per integration: the ranks run every variant in turn. The harness joins a gloo group
through a file store before the frameworks start, and the frameworks find it initialised (as
after a user's own ``init_process_group``); the torchrun-style variables they read are set per
rank, loopback only. Fresh processes (``fresh=True``), not the pool: the frameworks keep
process-wide singletons (Accelerate's ``PartialState``, Lightning's environment detection) that
a later case in the same process would inherit.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

import pytest
import torch

from gradsync.testing.spawn import spawn

WORLD = 2
MICRO = 2  # micro-batches per optimizer step (gradient accumulation)
BATCH = 2  # samples per rank and micro-batch
STEPS = 3  # optimizer steps
SAMPLES = STEPS * MICRO * BATCH * WORLD  # one epoch is exactly the run
# Learning rate and clipping norm per model, chosen so that clipping acts on some steps and not
# on others (the GPT's gradient norms are 0.99, 0.58, 0.60 against 0.7; the MLP's 1.69, 1.03,
# 1.43 against 1.2): a step that is always clipped would hide a wrongly scaled gradient.
HF_LR, HF_MAX_NORM = 0.5, 0.7
PL_LR, PL_MAX_NORM = 0.1, 1.2
# fp32, order-1 parameters: a few ulps of reduction-order difference (see test_equivalence.py).
TOL = 2e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _framework_env(rank: int, world: int, port: int) -> None:
    """What torchrun would set for this rank (the frameworks read it), loopback only."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        GROUP_RANK="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _describe(model: torch.nn.Module) -> dict[str, Any]:
    """What wrapped the model: its class, gradsync's count of synchronised backward passes,
    and the settings the framework and ``ddp_options`` gave gradsync's wrapper."""
    import gradsync

    out = {
        "type": f"{type(model).__module__}.{type(model).__qualname__}",
        "is_gradsync": isinstance(model, gradsync.DistributedDataParallel),
        "is_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
    }
    if out["is_gradsync"]:
        assert isinstance(model, gradsync.DistributedDataParallel)
        out["reductions"] = model.reducer.num_reductions
        out["settings"] = {
            "bucket_cap_mb": model.bucket_cap_mb,
            "num_buckets": model.num_buckets,
            "find_unused_parameters": model.find_unused_parameters,
            "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "timeout": model.timeout.total_seconds(),
        }
    return out


# -- HF: a tiny GPT-2, through Accelerate's loop and through Trainer ----------------------------
SEQ_LEN, VOCAB = 8, 64


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def _first_ignored(tokens: torch.Tensor) -> torch.Tensor:
    labels = tokens.clone()
    labels[0] = -100
    return labels


def _accelerate_loop(gradsync_wrapper: bool) -> dict[str, Any]:
    """Accelerate's documented loop: prepare, accumulate, backward, clip_grad_norm_."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from torch.utils.data import DataLoader

    from gradsync.integrations.accelerate import GradsyncAccelerator

    # Small buckets (several per step) and bucket views, through Accelerate's own handler.
    handler = DistributedDataParallelKwargs(bucket_cap_mb=0.01, gradient_as_bucket_view=True)
    kwargs: dict[str, Any] = {"cpu": True, "gradient_accumulation_steps": MICRO}
    kwargs["kwargs_handlers"] = [handler]
    if gradsync_wrapper:
        accelerator: Accelerator = GradsyncAccelerator(**kwargs, ddp_options={"timeout": 60})
    else:
        accelerator = Accelerator(**kwargs)
    raw = _gpt2()
    optimizer = torch.optim.SGD(raw.parameters(), lr=HF_LR)
    loader: DataLoader[Any] = DataLoader(_tokens(), batch_size=BATCH)  # type: ignore[arg-type]
    model, optimizer, loader = accelerator.prepare(raw, optimizer, loader)
    model.train()
    for tokens in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), HF_MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    return {
        **_describe(model),
        "accelerator": type(accelerator).__name__,
        "unwraps": accelerator.unwrap_model(model) is raw,
        "params": _params(raw),
    }


def _trainer(gradsync_wrapper: bool, out_dir: str) -> dict[str, Any]:
    """HF Trainer: per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm."""
    from transformers import Trainer, TrainingArguments

    from gradsync.integrations.accelerate import GradsyncTrainer

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=MICRO,
        max_grad_norm=HF_MAX_NORM, learning_rate=HF_LR, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_steps=STEPS, train_sampling_strategy="sequential", use_cpu=True,
        save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    # Label -100 at position 0, which the shifted loss never uses anyway: Trainer divides the
    # summed loss by the labels it counts, and then counts exactly the tokens the loss covers.
    data = [{"input_ids": t, "labels": _first_ignored(t)} for t in _tokens()]
    raw = _gpt2()
    if gradsync_wrapper:
        trainer = GradsyncTrainer(
            model=raw, args=args, train_dataset=data, ddp_options={"timeout": 60}
        )
    else:
        trainer = Trainer(model=raw, args=args, train_dataset=data)
    trainer.train()
    return {
        **_describe(trainer.model_wrapped),
        "accelerator": type(trainer.accelerator).__name__,
        "unwraps": trainer.accelerator.unwrap_model(trainer.model_wrapped) is raw,
        "params": _params(raw),
    }


def _hf_reference() -> dict[str, torch.Tensor]:
    """One process, the concatenated batches: one backward per optimizer step."""
    model = _gpt2()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=HF_LR)
    per_step = MICRO * BATCH * WORLD
    tokens = _tokens()
    for step in range(STEPS):
        batch = tokens[step * per_step : (step + 1) * per_step]
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HF_MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return _params(model)


def _hf_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    _framework_env(rank, world, port)
    out: dict[str, Any] = {}
    for name, gradsync_wrapper in (("gradsync", True), ("torch", False)):
        out[f"accelerate/{name}"] = _accelerate_loop(gradsync_wrapper)
    with tempfile.TemporaryDirectory(prefix=f"gradsync-trainer-{rank}-") as tmp:
        for name, gradsync_wrapper in (("gradsync", True), ("torch", False)):
            out[f"trainer/{name}"] = _trainer(gradsync_wrapper, tmp)
    out["reference"] = _hf_reference()
    out["initial"] = _params(_gpt2())
    return out


# -- Lightning: a tiny MLP, through the Trainer and through Fabric ------------------------------
def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(SAMPLES, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)


def _loader(distributed: bool = False) -> Any:
    """In order: rank r gets samples r, r + 2, ..., so the two ranks' micro-batches of a step
    are together the step's contiguous block of samples. Fabric makes the distributed sampler
    from this order itself; the Trainer's own would shuffle, so it gets one (``distributed``)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(*_regression())
    sampler: DistributedSampler[Any] | None = None
    if distributed:
        sampler = DistributedSampler(data, shuffle=False)
    assert not distributed or dist.get_world_size() == WORLD
    return DataLoader(data, batch_size=BATCH, shuffle=False, sampler=sampler)


def _lightning_trainer(gradsync_wrapper: bool, manual: bool = False) -> dict[str, Any]:
    """Lightning's Trainer with ``accumulate_grad_batches``, or with ``manual`` optimization
    as its docs show it: ``toggle_model(sync_grad=...)`` around ``manual_backward``, which
    runs inside the wrapper's forward (so the wrapper must decide at the backward's start)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from gradsync.integrations.lightning import GradsyncStrategy

    seen: dict[str, Any] = {}

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if not manual:
                return loss
            opt = self.optimizers()
            assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
            last = batch_idx % MICRO == MICRO - 1
            with opt.toggle_model(sync_grad=last):
                self.manual_backward(loss / MICRO)
            if last:
                self.clip_gradients(opt, gradient_clip_val=PL_MAX_NORM)
                opt.step()
                opt.zero_grad()
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=PL_LR)

        def on_train_end(self) -> None:
            wrapped = self.trainer.strategy.model  # still wrapped here
            assert wrapped is not None
            seen.update(_describe(wrapped))

    # find_unused_parameters and gradient_as_bucket_view: DDPStrategy's own keyword arguments.
    kwargs: dict[str, Any] = {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    if gradsync_wrapper:
        strategy: DDPStrategy = GradsyncStrategy(**kwargs, ddp_options={"timeout": 60})
    else:
        strategy = DDPStrategy(**kwargs)
    by_trainer = {"accumulate_grad_batches": MICRO, "gradient_clip_val": PL_MAX_NORM}
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS,
        **({} if manual else by_trainer),
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    module = Regression()
    trainer.fit(module, _loader(distributed=True))
    return {**seen, "params": _params(module.net)}


def _fabric(gradsync_wrapper: bool) -> dict[str, Any]:
    """Fabric's documented accumulation: no_backward_sync on all but a step's last micro-batch."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from gradsync.integrations.lightning import GradsyncFabricStrategy

    kwargs: dict[str, Any] = {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    if gradsync_wrapper:
        strategy: DDPStrategy = GradsyncFabricStrategy(**kwargs, ddp_options={"timeout": 60})
    else:
        strategy = DDPStrategy(**kwargs)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()  # the ranks exist already: this only sets up the strategy
    raw = _mlp()
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=PL_LR))
    loader = fabric.setup_dataloaders(_loader())
    for i, (x, y) in enumerate(loader):
        last = i % MICRO == MICRO - 1
        with fabric.no_backward_sync(model, enabled=not last):
            loss = torch.nn.functional.mse_loss(model(x), y) / MICRO
            fabric.backward(loss)
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=PL_MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    # Fabric's wrapper around the module holds the strategy's wrapper (gradsync's or torch's).
    return {**_describe(model._forward_module), "params": _params(raw)}


def _lightning_reference() -> dict[str, torch.Tensor]:
    net = _mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=PL_LR)
    x, y = _regression()
    per_step = MICRO * BATCH * WORLD
    for step in range(STEPS):
        rows = slice(step * per_step, (step + 1) * per_step)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), PL_MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return _params(net)


def _lightning_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    _framework_env(rank, world, port)
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from gradsync.integrations.lightning import GradsyncFabricStrategy, GradsyncStrategy

    out: dict[str, Any] = {
        # Trainer(strategy="gradsync") and Fabric(strategy="gradsync") resolve to these.
        "registered": (
            StrategyRegistry["gradsync"]["strategy"] is GradsyncStrategy
            and STRATEGY_REGISTRY["gradsync"]["strategy"] is GradsyncFabricStrategy
            and StrategyRegistry["ddp"]["strategy"].__name__ == "DDPStrategy"
        )
    }
    for name, gradsync_wrapper in (("gradsync", True), ("torch", False)):
        out[f"lightning/{name}"] = _lightning_trainer(gradsync_wrapper)
        out[f"manual/{name}"] = _lightning_trainer(gradsync_wrapper, manual=True)
        out[f"fabric/{name}"] = _fabric(gradsync_wrapper)
    out["reference"] = _lightning_reference()
    out["initial"] = _params(_mlp())
    return out


# -- the checks ---------------------------------------------------------------------------------
def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check(
    per_rank: list[dict[str, Any]], settings: dict[str, dict[str, Any]]
) -> dict[str, tuple[float, float]]:
    """Every run on every rank: the expected wrapper with the expected ``settings`` (per run,
    a subset of ``_describe``'s), one synchronised backward per optimizer step for gradsync,
    and the one-process reference's parameters. Returns each run's largest difference between
    gradsync and torch DDP, and between gradsync and the reference."""
    diffs: dict[str, tuple[float, float]] = {}
    for rank, out in enumerate(per_rank):
        reference = out["reference"]
        # Training moved the parameters far beyond the tolerance: equality is not trivial.
        assert _max_diff(reference, out["initial"]) > 1e3 * TOL
        for run, expected in settings.items():
            mine, theirs = out[f"{run}/gradsync"], out[f"{run}/torch"]
            where = f"{run}, rank {rank}"
            assert mine["is_gradsync"] and mine["is_torch_ddp"], (where, mine["type"])
            assert mine["reductions"] == STEPS, (where, mine["reductions"])
            got = {k: mine["settings"][k] for k in expected}
            assert got == expected, (where, got)
            assert not theirs["is_gradsync"] and theirs["is_torch_ddp"], (where, theirs["type"])
            for variant in (mine, theirs):
                assert variant.get("unwraps", True), where
                torch.testing.assert_close(variant["params"], reference, rtol=0, atol=TOL)
            vs_torch, vs_one = diffs.get(run, (0.0, 0.0))
            diffs[run] = (
                max(vs_torch, _max_diff(mine["params"], theirs["params"])),
                max(vs_one, _max_diff(mine["params"], reference)),
            )
    return diffs


def test_accelerate_and_trainer() -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    per_rank = spawn(_hf_rank, WORLD, (_free_port(),), timeout_s=240, fresh=True)
    for out in per_rank:
        assert out["accelerate/gradsync"]["accelerator"] == "GradsyncAccelerator"
        assert out["trainer/gradsync"]["accelerator"] == "GradsyncAccelerator"
        assert out["trainer/torch"]["accelerator"] == "Accelerator"
    diffs = _check(
        per_rank,
        {
            "accelerate": {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True, "timeout": 60},
            # The Trainer asks for find_unused_parameters for a model without checkpointing.
            "trainer": {"find_unused_parameters": True, "timeout": 60},
        },
    )
    assert all(out["accelerate/gradsync"]["settings"]["num_buckets"] > 1 for out in per_rank)
    print(f"max |diff| (vs torch DDP, vs one process): {diffs}")


def test_lightning_trainer_and_fabric() -> None:
    pytest.importorskip("lightning")
    per_rank = spawn(_lightning_rank, WORLD, (_free_port(),), timeout_s=240, fresh=True)
    assert all(out["registered"] for out in per_rank)
    forwarded = {"find_unused_parameters": True, "gradient_as_bucket_view": True, "timeout": 60}
    diffs = _check(per_rank, {"lightning": forwarded, "fabric": forwarded, "manual": forwarded})
    print(f"max |diff| (vs torch DDP, vs one process): {diffs}")


@pytest.mark.parametrize("package", ["accelerate", "lightning"])
def test_missing_framework_names_the_install_line(
    package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the framework, importing the integration says what to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # import of it raises ImportError
    monkeypatch.delitem(sys.modules, f"gradsync.integrations.{package}", raising=False)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(f"gradsync.integrations.{package}")
    message = str(raised.value)
    assert "pip install 'gradsync[integrations]'" in message, message
    assert "in a clone of gradsync: pip install -e '.[integrations]'" in message, message
