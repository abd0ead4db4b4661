"""gradsync's point-to-point ring refuses tensors off the CPU (see ring.py): its scratch buffers
are host memory and gloo's send/recv read raw pointers as host memory, so a CUDA bucket would be
sent as garbage or crash the process. A ``meta`` tensor stands in for a CUDA one here: both
fail the same check, which comes before any call into torch.distributed."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm.algorithm import CommStats
from gradsync.comm.ring import Ring, RingRunner
from gradsync.errors import UsageError


@pytest.mark.parametrize("direction", ["send", "recv"])
def test_the_ring_refuses_a_bucket_off_the_cpu_naming_the_fix(direction: str) -> None:
    runner, ring = RingRunner(CommStats()), Ring(None, (0, 1), 0)
    off_host = torch.empty(4, device="meta")
    call = runner._isend if direction == "send" else runner._irecv
    with pytest.raises(UsageError, match=r"host memory only.*on meta.*backend='nccl'"):
        call(off_host, ring, 0)
    assert runner.stats.bytes_sent == runner.stats.bytes_received == 0  # nothing was sent
