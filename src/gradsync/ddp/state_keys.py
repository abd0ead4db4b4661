"""State-dict keys of a wrapped model: the prefixes wrapping adds, and taking them off again."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

_PREFIXES = ("module.", "_orig_mod.")  # added by wrapping in DDP and by torch.compile


def strip_prefixes(
    state_dict: Mapping[str, Any], own_keys: Collection[str] | None = None
) -> dict[str, Any]:
    """Drop the ``module.`` / ``_orig_mod.`` prefixes that wrapping added to every key.

    A prefix is a wrapper's only if stripping it makes the keys match the module's own:
    among the dict as given and each successively stripped version, the one sharing the most
    keys with ``own_keys`` wins (the least stripped on a tie). So a model whose own child is
    called ``module`` keeps its real ``module.`` prefix, while ``module.module.`` from wrapping
    it in torch DDP loses one. Without ``own_keys``, every common prefix is stripped.
    """
    versions = [dict(state_dict)]
    while versions[-1]:
        keys = versions[-1]
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        versions.append({k[len(prefix) :]: v for k, v in keys.items()})
    if own_keys is None:
        return versions[-1]
    own = set(own_keys)
    return max(versions, key=lambda version: len(own.intersection(version)))
