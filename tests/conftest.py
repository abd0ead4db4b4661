"""The session's pool of gloo ranks (``gradsync.testing.pool``), and the two streams of
``make test``.

While it is open, :func:`gradsync.testing.spawn.spawn` runs its ranks on long-lived workers
instead of starting new processes for every case; ``spawn(..., fresh=True)`` still starts new
ones. When the session ends every worker must exit by itself with code 0, as a fresh rank must
after each run: a worker that crashes or hangs at interpreter shutdown fails the session.

``make test`` runs two pytest processes, one per core: ``--stream e2e`` takes the torchrun jobs
of ``tests/e2e`` (much of their time is spent waiting out grace periods and deadlines),
``--stream rest`` everything else plus the files of ``E2E_IN_REST``, moved over so that the two
end together. Without ``--stream`` pytest runs everything.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradsync.testing.pool import close_pool, open_pool

E2E_IN_REST = {"tests/e2e/test_train_gpt.py"}  # about 1.5 minutes of the e2e stream


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stream", choices=("e2e", "rest"), help="one of make test's two streams")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stream = config.getoption("--stream")
    if stream is None:
        return
    files = {item: item.nodeid.split("::")[0] for item in items}
    e2e = {i for i, f in files.items() if f.startswith("tests/e2e/") and f not in E2E_IN_REST}
    config.hook.pytest_deselected(items=[i for i in items if (i in e2e) != (stream == "e2e")])
    items[:] = [i for i in items if (i in e2e) == (stream == "e2e")]


@pytest.fixture(scope="session", autouse=True)
def rank_pool() -> Iterator[None]:
    open_pool()
    yield
    problems = close_pool()
    assert not problems, f"pooled ranks did not exit cleanly: {problems}"
