"""The buckets of one reducer, launched strictly in index order.

[Note: when a bucket fires]
A post-accumulate-grad hook on every trainable parameter marks its gradient as arrived in its
bucket. When the last gradient of a bucket arrives, the bucket copies them all into its flat
buffer (``buckets.py``) and its communication (an all-reduce by default; see [Note: the bucket
communication seam] in ``comm/hook.py``) is started asynchronously, while autograd goes on
computing earlier layers. Buckets are launched strictly in index order (a ready bucket waits
for its predecessors) because gloo and NCCL match collectives by the order they are issued: two
ranks that launched buckets in different orders would sum unrelated gradients. At the end of
backward (an autograd engine callback), buckets not launched yet, those holding a parameter
that got no gradient in this pass, are filled and launched (:meth:`LaunchQueue.launch_rest`);
then the reducer waits for every handle and writes the results to ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync.comm import CommHook
from gradsync.ddp.buckets import Bucket
from gradsync.failfast.deadline import Deadline
from gradsync.timing.ranges import span


class LaunchQueue:
    """Which bucket goes next, and the launch itself: copy in, flag, hand to the comm hook.

    ``scale`` is the pre-division of the backward in flight (see ``reduction.py``), set when it
    starts; ``marks`` is the step timeline's recorder (a bucket's launch is one of its marks).
    """

    def __init__(
        self, buckets: Sequence[Bucket], comm_hook: CommHook, marks: Any, check_finite: bool
    ) -> None:
        self.buckets, self.comm_hook, self.marks = list(buckets), comm_hook, marks
        self.check_finite = check_finite
        self.next = 0  # the next bucket to launch
        self.scale: float | None = None

    def launch_rest(self, zeros: bool, used: Sequence[bool]) -> None:
        """At the end of backward: fill the slots no hook filled (with their ``.grad``, or zeros
        for a rank that has joined) and launch every bucket not launched yet."""
        for bucket in self.buckets[self.next :]:
            for slot in range(len(bucket.params)):
                if not bucket.ready[slot]:
                    bucket.fill_late(slot, self.scale, zeros=zeros)
        self.launch_ready(used)
        assert self.next == len(self.buckets)

    def wait_all(self, deadline: Deadline, step: str, host_deadline: bool) -> None:
        """Wait for every bucket's reduction, in index order, under ``deadline``; on CUDA
        without a host deadline, then for the device too, before the readout's host read."""
        for bucket in self.buckets:
            assert bucket.work is not None
            what = f"{self.comm_hook.exchange} of bucket {bucket.spec.index} ({step})"
            deadline.wait(bucket.work, what, host_deadline=host_deadline)
        if not host_deadline and deadline.world_size > 1:
            done = torch.cuda.Event()
            done.record()
            deadline.wait_device(done, f"the gradient reduction of {step}")

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.next = 0

    def launch_ready(self, used: Sequence[bool]) -> None:
        """Launch every full bucket from the next one on, stopping at the first not full: a
        bucket filled out of order waits for those before it (a hook's call, once its bucket
        is full, and the end of backward's)."""
        buckets = self.buckets
        while self.next < len(buckets) and buckets[self.next].pending == 0:
            self._launch(buckets[self.next], used)
            self.next += 1

    def _launch(self, bucket: Bucket, used: Sequence[bool]) -> None:
        with span("bucket_copy_in"):
            bucket.gather(self.scale)
        if self.check_finite:
            bucket.flag_finite()  # read with the step's readout
        bucket.write_used_flags(used)
        self.marks.launched(bucket.spec.index)
        with span("bucket_launch"):
            bucket.work = self.comm_hook.start(bucket)
