"""The examples follow the library's function limit: a user copies an example, so it is read more
than the library is (nanoGPT's ``train.py`` is one flat loop)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_FUNCTION_LINES = 60  # tests/unit/test_layout.py's, for the library


def _long_functions(name: str, source: str) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def _as_formatted(path: Path) -> str:
    """The file as ``ruff format`` writes it without its ``# fmt: skip`` markers: a limit met by
    packing arguments several to a line moves the problem, it does not solve it."""
    source = re.sub(r"\s*# fmt: skip", "", path.read_text())
    cmd = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"]
    proc = subprocess.run(cmd, input=source, capture_output=True, text=True, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_there_are_examples() -> None:  # else the test below would have no case
    assert {"train_gpt.py", "train_3d.py", "train_recoverable.py"} <= {
        p.name for p in EXAMPLES.glob("*.py")
    }


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_no_function_of_an_example_is_too_long_to_read(path: Path) -> None:
    too_long = _long_functions(path.name, path.read_text())
    assert not too_long, too_long
    pytest.importorskip("ruff")
    too_long = _long_functions(path.name, _as_formatted(path))
    assert not too_long, f"as ruff formats it without '# fmt: skip': {too_long}"
