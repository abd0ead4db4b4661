"""PowerSGD's settings: each bad value is refused at construction, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from gradsync.comm import PowerSGD
from gradsync.errors import UsageError


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.0}, "rank"),
        ({"rank": True}, "rank"),
        ({"min_compression_rate": -1.0}, "min_compression_rate"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate"),
        ({"min_compression_rate": "2"}, "min_compression_rate"),
        ({"start_iter": -1}, "start_iter"),
        ({"start_iter": 1.0}, "start_iter"),
        ({"seed": 1.5}, "seed"),
        ({"seed": None}, "seed"),
        ({"seed": "0"}, "seed"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_bad_setting_is_refused(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        PowerSGD(**kwargs)


def test_good_settings() -> None:
    psgd = PowerSGD(1, min_compression_rate=0, start_iter=3, seed=2**32 - 1)
    assert (psgd.rank, psgd.min_compression_rate, psgd.start_iter) == (1, 0.0, 3)
