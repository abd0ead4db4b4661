"""What torch.compile's DDPOptimizer did, for the compile test and benchmark."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def ddp_optimizer_pieces() -> Iterator[list[int]]:
    """Yield a list that receives, for each graph DDPOptimizer compiles inside this block, the
    number of pieces it split the graph into (about one per bucket); torch's own
    ``compile_fn`` is restored on exit."""
    from torch._dynamo.backends import distributed as dynamo_ddp

    pieces: list[int] = []
    compile_fn = dynamo_ddp.DDPOptimizer.compile_fn

    def counting(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        compiled = compile_fn(self, gm, example_inputs, **kwargs)
        pieces.append(len(self.buckets))
        return compiled

    dynamo_ddp.DDPOptimizer.compile_fn = counting  # type: ignore[method-assign]
    try:
        yield pieces
    finally:
        dynamo_ddp.DDPOptimizer.compile_fn = compile_fn  # type: ignore[method-assign]
