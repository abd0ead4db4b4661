"""A logging handler that keeps each record's message: what a rank said, for a test to read."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Keeps the message of every record at ``level`` or above, in order (``lines``)."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
