"""How a wrapper forms a step's sum: the one seam between the default path and the deterministic
mode.

[Note: the mode seam]
The default mode sums each bucket on the wire the options chose, as its gradients arrive, each
rank's gradient scaled before the sum. The deterministic mode (``deterministic=``: ``leaves.py``
with ``leaf_buckets.py``, ``comm/tree_exchange.py`` and the contract in ``deterministic.py``)
sums a step's leaves in one fixed tree instead. Everything the two differ in is on a
:class:`Mode`, which the wrapper's state holds as it holds a comm hook:

- what is refused at construction (:meth:`Mode.check`) and by ``shard_optimizer()``
  (:meth:`Mode.check_sharding`);
- how the buckets travel (:meth:`Mode.comm_hook`);
- the reducer's class (:attr:`Mode.reducer_class`): the deterministic mode's overrides the few
  methods of :class:`~gradsync.ddp.reducer.Reducer` where a leaf differs from a micro-batch;
- when a rank inside ``join()`` takes part in the handshake
  (:attr:`Mode.handshake_each_forward`; [Note: leaves and join] in ``deterministic.py``).

So the default path reads without the mode, and no default step calls into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommHook
from gradsync.comm.formats import make_comm_hook
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.reducer import Reducer
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout


class Mode:
    """The default mode: buckets summed by the options' comm hook, scaled before the sum."""

    reducer_class: type[Reducer] = Reducer
    # Inside join(), every training forward answers the handshake (a rank with data runs the
    # same forwards as every other, and each may broadcast buffers).
    handshake_each_forward = True

    def check(
        self,
        options: SyncOptions,
        device: torch.device,
        world_size: int,
        buffers: bool,
        mesh_axes: tuple[str, ...],
        layouts: Sequence[GradLayout | None],
    ) -> None:
        """Refuse, at construction, what this mode cannot keep its promise with (``buffers``:
        the module has buffers the forwards broadcast)."""

    def check_sharding(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        params: Sequence[torch.Tensor],
        deadline: Deadline,
    ) -> None:
        """Refuse ``shard_optimizer(optimizer_class, **defaults)`` over ``params`` on every
        rank if this mode cannot keep its promise with it (it may gather under ``deadline``:
        every rank calls it)."""

    def comm_hook(
        self,
        options: SyncOptions,
        group: dist.ProcessGroup | None,
        named: list[tuple[str, nn.Parameter]],
        owner: nn.Module,
    ) -> CommHook:
        """How the buckets travel: the wire the options chose."""
        return make_comm_hook(
            options.compression,
            options.all_reduce,
            group,
            named,
            grad_dtype=options.main_grad_dtype,
            owner=owner,
            keep_undo=options.check_finite,
        )
