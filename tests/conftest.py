"""The session's pool of gloo ranks (``gradsync.testing.pool``).

While it is open, :func:`gradsync.testing.spawn.spawn` runs its ranks on long-lived workers
instead of starting new processes for every case; ``spawn(..., fresh=True)`` still starts new
ones. When the session ends every worker must exit by itself with code 0, as a fresh rank must
after each run: a worker that crashes or hangs at interpreter shutdown fails the session.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradsync.testing.pool import close_pool, open_pool


@pytest.fixture(scope="session", autouse=True)
def rank_pool() -> Iterator[None]:
    open_pool()
    yield
    problems = close_pool()
    assert not problems, f"pooled ranks did not exit cleanly: {problems}"
