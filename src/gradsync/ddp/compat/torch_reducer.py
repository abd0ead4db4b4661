"""The methods of torch's C++ ``Reducer`` that Accelerate and Lightning call on a DDP's
``.reducer``, with torch's meaning on gradsync's :class:`~gradsync.ddp.reducer.Reducer`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradsync.errors import ProtocolError


class TorchReducerMethods:
    """Mixed into the reducer; what they change goes through the reducer's own methods
    (``unprepared`` and ``decide``, declared here for the type checker only)."""

    if TYPE_CHECKING:

        @property
        def unprepared(self) -> bool: ...

        def decide(self, sync: bool) -> None: ...

    def prepare_for_backward(self, outputs: object = ()) -> None:
        """torch's meaning: the backward of the forward just run synchronises, even though that
        forward ran with ``require_backward_grad_sync=False`` (Accelerate's
        ``trigger_sync_in_backward``; Lightning calls it before every synchronising backward).
        ``outputs`` is torch's hint for finding unused parameters, which gradsync finds by
        itself."""
        if self.unprepared:
            raise ProtocolError(
                "reducer.prepare_for_backward() needs a forward through the wrapper first"
            )
        self.decide(True)

    def _rebuild_buckets(self) -> bool:
        """torch rebuilds its buckets once, after the first step; gradsync plans them at
        construction (or with ``bucket_cap_mb="auto"``): nothing to rebuild."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's static-graph first step defers its reduction to the end of backward;
        gradsync's first step reduces like every other: nothing was deferred."""
