"""Fixtures of the in-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture()
def one_rank(tmp_path) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """A gloo process group of world size 1 in this process (no spawn)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
