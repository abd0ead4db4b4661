"""The package's shape: one error hierarchy, a library that does not need its harnesses, and
modules small enough to read in one sitting."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gradsync
import gradsync.errors as errors

SRC = Path(gradsync.__file__).resolve().parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_gradsync_error_and_keeps_its_builtin(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.GradsyncError)
    if cls is not errors.GradsyncError:
        # Existing `except RuntimeError` / `except ValueError` clauses keep working.
        assert issubclass(cls, (RuntimeError, ValueError)), cls.__mro__
    # The prefix is added once, by the base class, whether or not the caller wrote it.
    assert str(cls("boom")) == "gradsync: boom"
    assert str(cls("gradsync: boom")) == "gradsync: boom"


def test_public_errors_are_exported_once_from_the_package() -> None:
    for name in gradsync.__all__:
        assert hasattr(gradsync, name), name
    exported_errors = {n for n in gradsync.__all__ if n.endswith("Error")}
    harness_errors = {"SpawnError", "ClusterError", "LaunchError"}
    assert exported_errors == set(errors.__all__) - harness_errors


def test_importing_the_library_does_not_import_the_harnesses() -> None:
    code = (
        "import sys, gradsync; "
        "print([m for m in sys.modules if m.startswith(('gradsync.testing', 'gradsync.bench', "
        "'gradsync.verify', 'gradsync.cli'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_file_or_function_is_too_long_to_read() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert files
    too_long = [
        f"{p.relative_to(SRC)} ({n} lines)"
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, too_long
    long_functions = [f for p in files for f in _long_functions(p)]
    assert not long_functions, long_functions
