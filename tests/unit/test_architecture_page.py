"""docs/architecture.md is true to the code: its map names every file of the library, and its
table of a step's control path names every file a training step enters."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import gradsync

SRC = Path(gradsync.__file__).resolve().parent
PAGE = (SRC.parents[1] / "docs" / "architecture.md").read_text()
WHOLE_FOLDERS = ("verify/", "bench/")  # named as a folder, with what it holds in words


def _section(start: str, end: str) -> str:
    return PAGE[PAGE.index(start) : PAGE.index(end)]


def test_the_file_map_names_every_file() -> None:
    files = PAGE[PAGE.index("## The files") :]
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(WHOLE_FOLDERS) or (path.name == "__init__.py" and rel != "__init__.py"):
            continue
        # testing/ is listed indented under its folder, by file name
        name = path.name if rel.startswith("testing/") else rel
        if name not in files:
            missing.append(rel)
    assert not missing, f"docs/architecture.md's file map lacks {missing}"


def test_the_control_path_table_names_every_file_a_step_enters(one_rank: None) -> None:
    # The defaults, a module with buffers (broadcast before each forward), three steps to warm
    # up (the first-batch check, the unused-last plan), then one step traced.
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    entered: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        filename = frame.f_code.co_filename
        if event == "call" and filename.startswith(str(SRC)):
            entered.add(Path(filename).relative_to(SRC).as_posix())

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    tables = _section("## The path of one gradient", "Optional settings add their own")
    assert "ddp/reducer.py" in entered and "ddp/forward.py" in entered
    missing = sorted(f for f in entered if f"`{f}`" not in tables)
    assert not missing, f"a step enters {missing}, which the control-path table does not name"
