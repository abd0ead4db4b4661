"""What a rank leaves in the arrival records for its peers (one rank, a real store): when it
raises, a record that names the operation, the error's type and its first line; while it waits,
its record, once a wait outlasts a moment, and nothing for a wait that ends sooner."""

from __future__ import annotations

from datetime import timedelta

import gradsync
from gradsync.failfast.arrivals import ArrivalRecords
from gradsync.failfast.deadline import Deadline, as_timedelta


def _deadline() -> tuple[Deadline, ArrivalRecords]:
    arrivals = ArrivalRecords(None, "records of errors")
    deadline = Deadline(None, as_timedelta(5), arrivals)
    deadline.begin("step 3")
    return deadline, arrivals


def test_an_error_is_recorded_with_its_type_and_first_line(one_rank) -> None:  # type: ignore[no-untyped-def]
    deadline, arrivals = _deadline()
    deadline.record_error(gradsync.UsageError("the first line\nand more"))
    seq, _, what = arrivals.read()[0]
    assert seq == deadline.seq
    assert what == "step 3, where it raised UsageError: gradsync: the first line"


def test_an_error_with_an_empty_message_is_recorded_by_its_type(one_rank) -> None:  # type: ignore[no-untyped-def]
    # str(error) == "": taking its first line must not raise IndexError over the real error.
    deadline, arrivals = _deadline()
    deadline.record_error(RuntimeError())
    assert arrivals.read()[0][2] == "step 3, where it raised RuntimeError: "


class _Work:
    """A collective in flight that completes after ``slices`` timed-out waits."""

    def __init__(self, slices: int) -> None:
        self.slices, self.waits = slices, 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if timeout is not None and self.waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.waits >= self.slices


def test_a_quick_wait_writes_no_record_and_a_long_one_writes_it_once(one_rank, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # [Note: records written when waiting]: the store hears of a step only when a wait lasts.
    deadline, arrivals = _deadline()
    written: list[str] = []
    real_set = arrivals._set
    monkeypatch.setattr(
        arrivals, "_set", lambda key, value: (written.append(value), real_set(key, value))
    )
    deadline.wait(_Work(slices=0), "a quick all-reduce")
    deadline.begin("step 4")
    deadline.wait(_Work(slices=0), "a quick all-reduce")
    assert written == [] and arrivals.read() == {}
    deadline.wait(_Work(slices=2), "a slow all-reduce")  # outlasts its first slice
    deadline.wait(_Work(slices=2), "another slow one, of the same operation")
    assert len(written) == 1 and written[0].startswith("2|") and written[0].endswith("|step 4")
    assert arrivals.read()[0][::2] == (2, "step 4")
