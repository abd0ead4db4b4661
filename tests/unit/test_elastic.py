"""torchrun restarts with a store shared across attempts are refused before new_group fails."""

from __future__ import annotations

import pytest

import gradsync.elastic as elastic
from gradsync import UsageError


def test_a_restart_on_a_shared_store_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(UsageError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic.check_restartable()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setattr(elastic, "_warned", False)
    with pytest.warns(UserWarning, match="a restart would fail"):
        elastic.check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the variable was set: fine
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    elastic.check_restartable()
