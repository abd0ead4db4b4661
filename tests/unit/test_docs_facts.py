"""Facts the docs state that the code decides: checked against the code, so that they cannot
drift apart."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import gradsync
from gradsync.checkpoint.folder import CheckpointFolder

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_usage_shows_the_constructor_signature_as_it_is() -> None:
    """docs/usage.md's constructor block: every parameter, in order, with its default."""
    text = (DOCS / "usage.md").read_text()
    block = re.search(r"```python\n(gradsync\.DistributedDataParallel\(.*?\n\))\n```", text, re.S)
    assert block, "docs/usage.md shows no constructor block"
    call = ast.parse(block.group(1).replace("*,", "_star_=None,")).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    shown = [(k.arg, ast.literal_eval(k.value)) for k in call.value.keywords if k.arg != "_star_"]
    params = list(inspect.signature(gradsync.DistributedDataParallel.__init__).parameters.values())
    real = [(p.name, p.default) for p in params[2:]]  # after self and module
    assert shown == real


def test_checkpoints_names_the_step_folders_as_they_are_on_disk(tmp_path: Path) -> None:
    text = (DOCS / "checkpoints.md").read_text()
    folder = CheckpointFolder(tmp_path)
    assert f"`save(11)` commits `{folder.step_dir(11).name}`" in text
    assert f"`{folder.partial_dir(11).name}`" in text
