"""A stand-in for a CUDA event, for the device deadline's polling without a GPU."""

from __future__ import annotations


class FakeEvent:
    """A CUDA event's ``query()``: done after ``after`` queries (never, if ``None``)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after
