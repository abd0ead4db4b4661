"""Every random number generator a training step may draw from, as tensors and plain values.

Dropout, data augmentation and shuffling draw from torch's CPU and CUDA generators, Python's
``random`` and NumPy's global generator. Each rank's generators are its own (a rank's dropout
masks differ from its peers'), so each rank saves and restores its own state: rank 0's file
cannot hold the others'. States are tensors or plain values so they load with
``weights_only=True`` (NumPy's state is a tuple holding an array, which the safe loader refuses).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from gradsync.errors import CheckpointError

try:
    import numpy as np
except ImportError:  # NumPy is optional
    np = None  # type: ignore[assignment]


def get_rng_state() -> dict[str, Any]:
    """This process's generator states: ``torch``, ``cuda`` (when initialised), ``python``,
    ``numpy`` (when installed)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    if np is not None:
        numpy_state: Any = np.random.get_state()
        name, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def set_rng_state(state: dict[str, Any], where: str) -> None:
    """Restore what :func:`get_rng_state` returned; ``where`` names the checkpoint in errors."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(state["cuda"]):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise CheckpointError(
                f"{where}: saved the RNG states of {len(state['cuda'])} CUDA device(s), this "
                f"process sees {have}: dropout on the GPU cannot continue the same stream"
            )
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state and np is not None:
        n = state["numpy"]
        keys = n["keys"].numpy().astype("uint32")
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
