"""Checkpoints that cannot be half-written and that load with ``weights_only=True``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``obj`` to ``path`` atomically: a temp file in the same folder, fsync, then rename.

    A crash mid-write leaves the previous checkpoint intact: readers only ever see a complete
    file. Save only tensors and plain containers (a module's ``state_dict()``, an optimizer's),
    so the file loads with ``torch.load(path, weights_only=True)``. Call it on one rank only.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint onto the CPU, refusing pickled objects (``weights_only=True``)."""
    return torch.load(path, map_location="cpu", weights_only=True)
