"""Checkpoints on real gloo ranks: the wrapper's prefix handling and the training checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import gradsync
from gradsync.checkpoint import load_checkpoint, save_checkpoint
from gradsync.testing.spawn import spawn


class Holder(nn.Module):
    """A user's model whose only child is called ``module``: every key starts with "module."."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 2)


def _prefixes(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(rank)
    ddp = gradsync.DistributedDataParallel(Holder())
    path = Path(folder) / f"holder-{rank}.pt"
    save_checkpoint(ddp.state_dict(), path)
    fresh = gradsync.DistributedDataParallel(Holder())
    with torch.no_grad():
        fresh.module.module.weight.zero_()
    fresh.load_state_dict(load_checkpoint(path))  # strict: its own keys, prefix kept
    torch_ddp_style = {f"module.{k}": v for k, v in ddp.state_dict().items()}
    again = gradsync.DistributedDataParallel(Holder())
    again.load_state_dict(torch_ddp_style)  # one wrapper prefix stripped, not two
    return {
        "keys": sorted(ddp.state_dict()),
        "equal": all(
            torch.equal(a, b) and torch.equal(a, c)
            for a, b, c in zip(
                ddp.parameters(), fresh.parameters(), again.parameters(), strict=True
            )
        ),
    }


def test_a_model_with_a_child_named_module_round_trips(tmp_path: Path) -> None:
    for out in spawn(_prefixes, 2, (str(tmp_path),)):
        assert out["keys"] == ["module.bias", "module.weight"]
        assert out["equal"]
