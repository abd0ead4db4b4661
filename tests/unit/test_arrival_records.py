"""What a rank leaves in the arrival records for its peers when it raises (one rank, a real
store): the record names the operation, the error's type and its first line."""

from __future__ import annotations

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
