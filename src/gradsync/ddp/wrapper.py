"""``gradsync.DistributedDataParallel``: the user-facing wrapper.

Construction makes replicas equal (model check, rank 0 broadcast) and plans the buckets; the
:class:`~gradsync.ddp.reducer.Reducer` does the per-step work from autograd hooks. Read
``naive.py`` first: this module does the same thing, overlapped with backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import AllReduceAlgorithm, get_algorithm
from gradsync.ddp.buckets import BucketSpec, cap_to_bytes, plan_buckets
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.replicas import broadcast_from_rank0, check_same_model, describe

REDUCTIONS = ("mean", "sum")
_PREFIXES = ("module.", "_orig_mod.")  # added by wrapping in DDP and by torch.compile


class DistributedDataParallel(nn.Module):
    """Data parallelism whose N-process training equals one-process training on the full batch.

    Args:
        module: the model; every rank must hold the same parameter names, shapes, dtypes and
            ``requires_grad`` flags (checked here; a mismatch raises ``ValueError`` on every rank).
        process_group: the ranks that hold replicas (default: the world).
        bucket_cap_mb: bucket size in MiB. ``0``: one all-reduce per parameter; ``None``: one
            bucket (per dtype).
        find_unused_parameters: count a parameter without a gradient on some rank as zero there.
            When ``False`` such a parameter raises :class:`UnusedParametersError` on every rank at
            the end of the backward pass that missed it.
        gradient_as_bucket_view: make ``.grad`` tensors views into the bucket buffers (saves one
            copy and the memory of one set of gradients).
        broadcast_buffers: before each training-mode forward with grad enabled, copy rank 0's
            buffers (e.g. BatchNorm running statistics) to every rank.
        reduction: ``"mean"`` averages gradients over ranks (for mean-reduced losses);
            ``"sum"`` sums them (for sum-reduced losses).
        algorithm: the all-reduce used for every bucket: a name from ``gradsync.comm.ALGORITHMS``
            or an :class:`~gradsync.comm.AllReduceAlgorithm` instance.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = 25.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        reduction: str = "mean",
        algorithm: str | AllReduceAlgorithm = "native",
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "gradsync: torch.distributed is not initialised; call "
                "dist.init_process_group(...) (torchrun sets up its environment) first"
            )
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.module = module
        self.process_group = process_group
        self.reduction = reduction
        self.broadcast_buffers = broadcast_buffers
        self.algorithm = get_algorithm(algorithm)
        cap_bytes = cap_to_bytes(bucket_cap_mb)

        named_params = list(module.named_parameters())
        named_buffers = list(module.named_buffers())
        settings = {
            "bucket_cap_mb": bucket_cap_mb,
            "reduction": reduction,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "broadcast_buffers": broadcast_buffers,
            "algorithm": self.algorithm.name,
        }
        check_same_model(describe(named_params, named_buffers), settings, process_group)
        broadcast_from_rank0(
            [p.data for _, p in named_params] + [b for _, b in named_buffers], process_group
        )
        self._buffers_to_sync = [b for _, b in named_buffers]

        # named_parameters() already yields a tied parameter once, so it is reduced once.
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        self.bucket_specs: list[BucketSpec] = plan_buckets(
            [(p.numel(), p.dtype) for _, p in trainable], cap_bytes
        )
        self.reducer = Reducer(
            trainable,
            self.bucket_specs,
            process_group=process_group,
            algorithm=self.algorithm,
            reduction=reduction,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self._require_sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            # Eval and no_grad forwards issue no collectives: rank-0-only evaluation is safe.
            if self.broadcast_buffers and self.module.training and self._buffers_to_sync:
                broadcast_from_rank0(self._buffers_to_sync, self.process_group)
            self.reducer.prepare_for_backward(sync=self._require_sync)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for forwards run inside this context.

        As in torch DDP the forward decides: the backward of a forward run inside ``no_sync``
        does not communicate, and the next synchronised backward reduces everything
        accumulated, once per bucket.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait for outstanding reductions; idempotent. Backward already calls it at its end."""
        self.reducer.finish_gradient_synchronization()

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_specs)

    # -- checkpoints: keys are the unwrapped module's --------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(strip_prefixes(state_dict), strict=strict, assign=assign)


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop ``module.`` / ``_orig_mod.`` prefixes that every key carries."""
    out = dict(state_dict)
    changed = True
    while changed and out:
        changed = False
        for prefix in _PREFIXES:
            if all(k.startswith(prefix) for k in out):
                out = {k[len(prefix) :]: v for k, v in out.items()}
                changed = True
    return out
