"""The deterministic mode's contract: what it needs, checked where it can be, and what it refuses.

[Note: what the same bits need]
``DistributedDataParallel(model, deterministic=L)`` sums each step's ``L`` leaf gradients in one
fixed tree ([Note: the fixed leaf tree] in ``comm/tree.py``), so the reduction no longer
depends on N. The parameters are then the same bits at every N only if everything else is too:

- *Each leaf's gradient is the same bits wherever it is computed.* The same samples in the same
  leaf (``GlobalBatchSampler(..., deterministic=True)`` cuts them so), the same model code, and
  the same kernels: on CPU the same number of intra-op threads per rank (a matmul may split its
  sums by thread), on GPU ``torch.use_deterministic_algorithms(True)`` (with
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), the same GPU model and library versions. Ranks must
  agree on both, which is checked at construction with the other settings; two runs at
  different N must agree too, which no process can check: set ``OMP_NUM_THREADS`` (torchrun
  sets 1 per process when it starts several) and keep it when N changes.
- *Randomness follows the leaf, not the rank*: no dropout drawn from a per-rank generator (data
  randomness can follow each sample with :func:`gradsync.data.sample_generator`).
- *Every scale is applied once, after the sum*: ``"sum"`` adds, ``"item_mean"`` divides by the
  step's item count, ``"mean"`` divides by the step's number of leaves (so each leaf's loss is
  a mean over its samples, *not* also divided by the accumulation steps, which differ between
  ranks here). No pre-division, whatever N.
- *Anything after the reduction is computed the same way at every N*: the optimizer step on
  replicated gradients is; a gradient norm summed over ranks' slices is not. ZeRO-1 is, where
  its optimizer steps a slice to the whole tensor's bits ([Note: ZeRO-1 in the deterministic
  mode]).

[Note: ZeRO-1 in the deterministic mode]
``shard_optimizer()`` keeps the three things the same bits need. The gradient: the wrapper's
ZeRO-1 reduces the buckets exactly as without it ([Note: sharded steps in the wrapper] in
``sharding.py``), here by the fixed tree, and every rank holds the full sum in ``.grad``. The
clipping norm: ``opt.clip_grad_norm_`` and torch's ``clip_grad_norm_`` read that full ``.grad``
on every rank, parameter by parameter in one order, with no collective, so no rank's slice is
summed apart and N never enters (a norm of per-rank partial sums would: the test that moves N
fails when the norm is taken so). The step: each rank steps its slices, which cut parameters
where N puts the cut, and an element gets the bits it gets in the whole tensor only if the
optimizer's kernels compute every element by one formula; torch's fused CPU kernels do not
([Note: a piece's step, bit for bit] in ``optim/piecewise.py``). So ``shard_optimizer()``
steps a probe whole and in pieces with the job's optimizer and settings, on the parameters'
dtypes and device, and refuses on every rank where the bits differ. Checkpoints reshard the
state per parameter (``optim/state.py``), so a resume at another N loads the same bits.

[Note: leaves and join]
Ranks run different numbers of leaves per step when N does not divide ``L``, so a collective
per forward cannot pair up across ranks. So in this mode no forward broadcasts buffers (a module
with buffers needs ``broadcast_buffers=False``: buffers that training changes, BatchNorm's
running statistics, then depend on which leaves a rank ran and are outside the guarantee), and
inside ``join()`` the handshake runs once per step, at each rank's synchronised forward (its
last leaf: ``LeafMode.handshake_each_forward`` in ``leaves.py``). It comes after the
collectives of a step's first forward (the first-batch fingerprint, the replica check) in
either mode ([Note: the forward protocol]), so every rank issues them in the same order
whether its first and last leaf are one forward or two.

[Note: leaves on a device mesh]
Over a 1-D data-parallel mesh (``device_mesh=mesh["dp"]``) with tensor-parallel DTensor
parameters, a leaf is computed by every rank of its tp group together: the same samples, the
same shards, the same tp collectives in the same order, so at a fixed tp size each rank's local
shard of a leaf's gradient is the same bits whichever dp rank computes it. The tree then sums
local shards over the dp ranks, as it sums whole gradients without a mesh. Autograd's pairing
of leaves ([Note: autograd adds the first level] in ``leaf_buckets.py``) is off for DTensor
gradients: a Partial gradient is reduced over tp when the bucket takes it, and reducing two
leaves added together rounds differently from adding the two reduced. A cp axis is refused:
its ranks hold chunks of one leaf, whose contributions would be summed in an order of their own.

[Note: a new bucket plan changes no sum]
``bucket_cap_mb="auto"`` lays the buckets out again after its profiled steps (``replan/``),
always at a step boundary, where no leaf is held. The tree adds each gradient element over the
same leaves in the same order whichever bucket the element lies in, so a plan changes what
travels together, never a sum: the parameters are the bits of a fixed plan.

Refused, naming why: lossy wires (``compression=``; they round partial sums), another
``algorithm=`` and torch comm hooks (they choose the summation order), ``shard_optimizer()``
with an optimizer that steps a slice to other bits than the whole (above), a ``device_mesh`` of
more than one data-parallel axis (above).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync.errors import UsageError
from gradsync.failfast.deadline import Deadline
from gradsync.optim.buffers import check_optimizer_class
from gradsync.optim.piecewise import piecewise_mismatch

_WHY = "the deterministic mode (deterministic=) sums the leaves in its own fixed order"


def refuse_in_deterministic_mode(leaves: object, compression: object, algorithm: str) -> None:
    """Check ``deterministic`` (``leaves``) and refuse the settings (``SyncOptions``'s) it
    cannot keep its promise with."""
    if leaves is None:
        return
    if isinstance(leaves, bool) or not isinstance(leaves, int) or leaves < 1:
        raise UsageError(
            f"deterministic must be the number of leaves per step (a positive int, e.g. "
            f"GlobalBatchSampler(..., deterministic=True).leaves_per_step) or None, got "
            f"{leaves!r}"
        )
    if compression is not None:
        raise UsageError(
            f"compression={compression!r} cannot be combined with deterministic=: a "
            "lossy wire rounds partial sums, whose grouping depends on the world size; "
            f"{_WHY}"
        )
    if algorithm != "native":
        raise UsageError(
            f"algorithm={algorithm!r} cannot be combined with deterministic=: "
            f"{_WHY}, not an all-reduce's"
        )


def deterministic_settings(leaves: int | None) -> dict[str, Any]:
    """What every rank must agree on for the same compute per leaf (compared at construction
    with the other settings; see [Note: what the same bits need])."""
    if leaves is None:
        return {}
    return {
        "torch.get_num_threads() (deterministic mode)": torch.get_num_threads(),
        "torch.are_deterministic_algorithms_enabled() (deterministic mode)": (
            torch.are_deterministic_algorithms_enabled()
        ),
    }


def check_compute(
    leaves: int | None, device: torch.device, world_size: int, broadcast_buffers: bool
) -> None:
    """Refuse what is known at construction to break the same compute per leaf, or the
    pairing of collectives ([Note: leaves and join])."""
    if leaves is None:
        return
    if broadcast_buffers:
        raise UsageError(
            "deterministic= with a module that has buffers needs broadcast_buffers=False: "
            "ranks run different numbers of leaves per step, so a broadcast per forward cannot "
            "pair up (buffers that training changes, like BatchNorm's running statistics, then "
            "differ per rank and are outside the same-bits guarantee)"
        )
    if leaves < world_size:
        raise UsageError(
            f"deterministic={leaves} leaves per step over {world_size} ranks: every rank needs "
            "at least one leaf of a full step; use more, smaller leaves"
        )
    if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        raise UsageError(
            "deterministic= on CUDA needs torch.use_deterministic_algorithms(True) on every "
            "rank (and CUBLAS_WORKSPACE_CONFIG=:4096:8): otherwise a leaf's gradient may "
            "depend on kernel scheduling"
        )


def refuse_mesh(mesh_axes: tuple[str, ...], layouts: Sequence[object]) -> None:
    """The deterministic mode over a device mesh of more than one data-parallel axis: refused.

    One axis is supported, DTensor parameters included ([Note: leaves on a device mesh])."""
    if len(mesh_axes) > 1:
        raise UsageError(
            f"deterministic= cannot be combined with a device_mesh of {len(mesh_axes)} "
            f"data-parallel axes {mesh_axes}: the leaves are micro-batches of one axis, and "
            "context-parallel contributions to a gradient (chunks of the same leaf) would be "
            "summed in an order of their own. Pass the one data-parallel axis (mesh['dp'])"
        )


def check_sharding(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    params: Sequence[torch.Tensor],
    deadline: Deadline,
) -> None:
    """``shard_optimizer(optimizer_class, **defaults)`` over ``params`` in the deterministic
    mode: refused on every rank (one gather) where stepping slices changes the bits ([Note:
    ZeRO-1 in the deterministic mode])."""
    check_optimizer_class(optimizer_class)  # its own error first, not a probe's
    mine = [
        why
        for dtype, device in dict.fromkeys((p.dtype, p.device) for p in params)
        if (why := piecewise_mismatch(optimizer_class, defaults, dtype, device)) is not None
    ]
    what = "the deterministic mode's check of shard_optimizer()"
    deadline.begin(what)
    per_rank = deadline.gather_objects(mine, what)
    lines = "\n".join(f"  rank {r}: {'; '.join(w)}" for r, w in enumerate(per_rank) if w)
    if lines:
        name = optimizer_class.__name__
        raise UsageError(
            f"shard_optimizer({name}, {defaults}) cannot be combined with deterministic=: "
            f"each rank steps its slice of the parameters, cut where the world size puts the "
            f"cut, and {name} with these settings does not step a slice to the bits of the "
            f"whole tensor:\n{lines}\nOn CPU pass fused=False (torch's fused kernels round a "
            "tensor's last elements another way), or use a replicated optimizer"
        )
