"""What the synchronised gradient means: gradsync's reduction semantics, all in this file.

The wire only ever sums (``gradsync.comm``). What that sum is divided by is decided here:

- ``"mean"``: by the number of *active ranks*, the ranks that contribute data to this
  reduction (all of them, except inside ``join()`` where ranks that ran out of data answer
  with zeros; see ``join.py``). Use with mean-reduced losses. The division happens *before*
  the sum (*pre-division*): each rank scales its gradient by ``1 / active`` while copying it
  into the bucket, as torch DDP does, which keeps low-precision sums in range and costs no
  extra pass over the buffer.
- ``"sum"``: by nothing. Use with sum-reduced losses.
- ``"item_mean"``: by the *item count*, the number of items (samples, valid tokens) declared
  with ``count_items`` on every rank and micro-batch of the accumulation window: the exact mean
  over items whatever the split. Use with sum-reduced losses. The counts are summed by one small
  all-reduce per optimizer step (the *item exchange*), issued before the first bucket, and the
  division happens after the sum, once the total is known.

The naive reference (``naive.py``) follows the same definitions with every rank active,
dividing after the sum. Anything else silently changes the learning rate, so there is
nothing else.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradsync.errors import UsageError
from gradsync.failfast.deadline import Handle

REDUCTIONS = ("mean", "sum", "item_mean")


def check_reduction(reduction: str, allowed: tuple[str, ...] = REDUCTIONS) -> str:
    """``reduction`` if it is one of ``allowed``, else ``ValueError`` naming the choices."""
    if reduction not in allowed:
        raise UsageError(f"reduction must be one of {allowed}, got {reduction!r}")
    return reduction


class Reduction:
    """One wrapper's reduction: the pre-division factor and, for ``item_mean``, the item count."""

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.name = check_reduction(name)
        self.group = group
        self.local_items = 0.0  # declared on this rank in the current accumulation window
        self.declared = False  # count_items() was called in this window (0 items is legal)
        # The item exchange's buffer; float64 so counts stay exact far beyond 2**24.
        self.total_items = torch.zeros(1, dtype=torch.float64, device=device)
        # Counts given as tensors, added up where they are: reading one on the host would
        # wait for the GPU at every micro-batch (see [Note: counts as tensors]).
        self.device_items = torch.zeros(1, dtype=torch.float64, device=device)
        self.tensor_counted = False
        self.exchange: Handle | None = None

    @property
    def counts_items(self) -> bool:
        return self.name == "item_mean"

    def pre_division(self, num_active: int, wire_divides: int = 1) -> float | None:
        """The factor each rank's gradient is multiplied by before the sum (``None``: 1).

        ``wire_divides``: what the bucket communication divides its sum by
        (``CommHook.divides_by``): 1 for gradsync's hooks, the world size for torch's
        ``ddp_comm_hooks``, which average (torch DDP hands them undivided gradients).
        Multiplying by it keeps the result's meaning the same either way."""
        factor = float(wire_divides)
        if self.name == "mean":
            factor /= num_active
        return None if factor == 1.0 else factor

    # [Note: counts as tensors]
    # The natural count of a micro-batch is a tensor on the GPU, e.g. (labels != -100).sum().
    # Converting it with float() waits for the GPU to finish everything queued so far, at every
    # micro-batch, and stalls the pipeline. A tensor count is added to a device accumulator
    # instead, which joins the item exchange's buffer without a host read; the values are
    # checked in the total, which the step's readout reads anyway (one read per step), on every
    # rank alike. A negative count on one rank can hide behind the others' there, where a
    # Python number is refused at once: pass numbers where the count is on the host already.
    def count_items(self, num_items: float | torch.Tensor) -> None:
        """Add ``num_items`` to this rank's count for the current window."""
        if not self.counts_items:
            raise UsageError(
                f"count_items() needs reduction='item_mean' (this wrapper has "
                f"reduction={self.name!r})"
            )
        self.declared = True
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex():
                raise UsageError(f"count_items() needs one number, got a tensor {num_items}")
            count = num_items.detach().reshape(1).to(self.device_items, non_blocking=True)
            self.device_items.add_(count)  # checked in the total (see the note above)
            self.tensor_counted = True
            return
        value = float(num_items)
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"count_items() needs a finite count >= 0, got {num_items}")
        self.local_items += value

    @property
    def missing_count(self) -> bool:
        """``item_mean`` and no ``count_items()`` in this window: the divisor would lack this
        rank's items (a forgotten call; declaring 0 items is legal and not this)."""
        return self.counts_items and not self.declared

    def start_item_exchange(self, contributes: bool) -> None:
        """Start summing the window's counts over ranks (``item_mean`` only; a rank that has
        joined takes part with zero items). Issued before the first bucket on every rank."""
        if self.counts_items:
            self.total_items.fill_(self.local_items if contributes else 0.0)
            if contributes and self.tensor_counted:
                self.total_items.add_(self.device_items)
            self.exchange = dist.all_reduce(self.total_items, group=self.group, async_op=True)

    def post_divide(self, grads: list[torch.Tensor], total_items: float) -> None:
        """Divide the summed gradients by the global item count (``item_mean`` only)."""
        if not self.counts_items:
            return
        if not math.isfinite(total_items) or total_items < 0:
            # A count given as a tensor is checked here, in the total every rank reads alike.
            raise UsageError(
                f"count_items() was given a negative or non-finite count on some rank: the "
                f"window's total is {total_items}; counts must be finite and >= 0"
            )
        if total_items <= 0:
            # Every rank read the same total, so every rank raises here.
            raise UsageError(
                "reduction='item_mean' but no rank declared any items in this accumulation "
                "window; call model.count_items(n) for every micro-batch"
            )
        torch._foreach_div_(grads, total_items)

    def reset(self) -> None:
        """Start a new accumulation window."""
        self.local_items = 0.0
        self.declared = False
        self.exchange = None
        if self.tensor_counted:
            self.device_items.zero_()
            self.tensor_counted = False
