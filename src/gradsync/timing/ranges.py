"""gradsync's work as named ranges in ``torch.profiler`` traces (Perfetto, Chrome's tracing).

Each range is a ``record_function``: ``gradsync::bucket_copy_in`` (gradients into a bucket),
``gradsync::bucket_launch`` (its communication started), ``gradsync::bucket_wait`` (waiting
for it at the end of backward), ``gradsync::bucket_write_back`` (results to ``.grad``) and
``gradsync::step_checks`` (the readout and the step's verdicts). A trace then shows what ran
under backward and what was left exposed after it. Without a profiler a range is not entered
at all: a check of one flag.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.autograd.profiler import record_function

_OFF = nullcontext()


def span(name: str) -> AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``gradsync::<name>`` while a profiler is on."""
    if torch._C._autograd._profiler_enabled():
        return record_function(f"gradsync::{name}")
    return _OFF
