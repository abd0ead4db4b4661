"""What a training checkpoint holds, and how it goes back into the live objects.

model         the unwrapped module's state_dict (replicated: DCP writes it once, spread
              over the ranks, and reshards it on load)
optimizer     torch.distributed.checkpoint.state_dict's optimizer state, keyed by
              parameter name (the form sharded optimizers and DTensor states take too;
              MasterWeights adds its fp32 weights under "master")
lr_scheduler  the scheduler's state_dict
gradsync      the wrapper's sync_state_dict(): step counter, last replica check
rank.<r>      what belongs to rank r alone: its RNG states and its sampler position

[Note: resuming at another world size]
A checkpoint saved by N ranks loads into N' ranks when nothing in it belongs to one rank of
the N: the model, the optimizer (a sharded optimizer's slices are DCP shards of whole tensors,
which DCP cuts anew for N'), the LR schedule and gradsync's step counter are the job's, and a
sampler whose position is the global step (``gradsync.data``'s ``world_size_independent``
samplers) is the same on every rank, so rank 0's is loaded everywhere. What cannot follow is
refused before anything is loaded: compression state (PowerSGD's error feedback and matrices
are each rank's own) and a per-rank sampler position (``DistributedSampler``: rank r's share
of an epoch depends on N). Each rank's RNG states are not restored: random numbers drawn per
rank (dropout) cannot follow the samples to other ranks, so a model that draws them continues
differently from an uninterrupted run (the load warns); data randomness derived per sample
does follow.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from gradsync.checkpoint.rng import get_rng_state, set_rng_state
from gradsync.ddp.compat.state_keys import refuse_mid_step
from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import CheckpointError
from gradsync.fsdp.layout import gradients_held_back
from gradsync.optim.master import MasterWeights
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.optim.state import StateShard


@dataclass
class TrainingObjects:
    """The live objects whose state a training checkpoint saves and restores."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | MasterWeights | None = None
    lr_scheduler: Any = None
    sampler: Any = None  # anything with state_dict() / load_state_dict()

    @property
    def module(self) -> nn.Module:
        model = self.model
        return model.module if isinstance(model, DistributedDataParallel) else model

    def state_dict(
        self, rank: int, saved_keys: Iterable[str] | None = None, resized: bool = False
    ) -> dict[str, Any]:
        """The state to save (live tensors: :func:`snapshot` copies them), or with the
        ``saved_keys`` of a checkpoint, the template to load it into; ``resized``: a template
        for a checkpoint of another world size (see [Note: resuming at another world size]).

        A module sharded with ``fully_shard`` (FSDP2) is saved as DCP expects: its
        ``state_dict()`` holds DTensor shards, each rank writing its own and DCP cutting them
        anew for the loading mesh, and the optimizer's state is DTensors alike; refused inside
        an accumulation window (FSDP2 holds the no-sync gradients, which no checkpoint saves)."""
        if saved_keys is None and isinstance(self.model, FSDPModule):
            refuse_mid_step(gradients_held_back(self.model), 0)
        state: dict[str, Any] = {"model": self.model.state_dict()}  # a wrapper's: keys of
        # the module's own, after a sharded optimizer's parameter all-gathers
        if isinstance(self.optimizer, ShardedOptimizer):  # each rank its slices (resharding)
            state["optimizer"] = self.optimizer.sharded_state_dict()
        elif self.optimizer is not None:
            state["optimizer"] = self._optimizer_state(saved_keys)
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if isinstance(self.model, DistributedDataParallel):
            state["gradsync"] = self.model.sync_state_dict()
        if resized:  # rank 0's sampler position, which is every rank's; no RNG states
            if self.sampler is not None:
                state["rank"] = {"0": {"sampler": self.sampler.state_dict()}}
            return state
        mine: dict[str, Any] = {"rng": get_rng_state()}
        if self.sampler is not None:
            mine["sampler"] = self.sampler.state_dict()
        state["rank"] = {str(rank): mine}
        return state

    def _optimizer_state(self, saved_keys: Iterable[str] | None) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name.

        torch's ``get_optimizer_state_dict`` (and :meth:`MasterWeights.named_state_dict`) first
        give an optimizer that has not stepped yet its state, by one step on zero gradients at
        lr 0. That step moves no weight but counts: AdamW's next step would be its second, with
        another bias correction, so a checkpoint taken before the first step would change the
        training it records. So a save then takes that state away again and writes none, and
        a load of such a checkpoint (no ``optimizer.state.*`` keys) leaves the optimizer
        without state, as it was when saved.
        """
        opt = self.optimizer
        inner = opt.optimizer if isinstance(opt, MasterWeights) else opt
        assert inner is not None
        if saved_keys is None:
            unstepped = not inner.state
        else:
            unstepped = not any(k.startswith("optimizer.state.") for k in saved_keys)
        if isinstance(opt, MasterWeights):
            state = opt.named_state_dict(self._master_names())
        else:
            state = get_optimizer_state_dict(self.module, opt)  # type: ignore[arg-type]
        if unstepped:
            state = {**state, "state": {}}
            if saved_keys is None:
                inner.state.clear()
        return state

    def _master_names(self) -> list[str]:
        assert isinstance(self.optimizer, MasterWeights)
        names = {id(p): name for name, p in self.module.named_parameters()}
        return [names[id(p)] for p in self.optimizer.params]

    def load_state_dict(
        self, state: dict[str, Any], rank: int, where: str, resized: bool = False
    ) -> None:
        """Put a loaded state back, RNG last (see ``DistributedSampler.call_on_resume``)."""
        self.model.load_state_dict(state["model"])
        if isinstance(self.optimizer, ShardedOptimizer):  # DCP loaded into its live slices
            self.optimizer.load_sharded_state_dict(state["optimizer"])
        elif isinstance(self.optimizer, MasterWeights):
            self.optimizer.load_named_state_dict(state["optimizer"], self._master_names())
        elif self.optimizer is not None:
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if isinstance(self.model, DistributedDataParallel):
            self.model.load_sync_state_dict(state["gradsync"])
        if resized:
            if self.sampler is not None:
                self.sampler.load_state_dict(state["rank"]["0"]["sampler"])
            return
        mine = state["rank"][str(rank)]
        rng = mine["rng"]
        if self.sampler is not None:
            self.sampler.load_state_dict(mine["sampler"])
            if hasattr(self.sampler, "call_on_resume"):
                self.sampler.call_on_resume(lambda: set_rng_state(rng, where))
        set_rng_state(rng, where)


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are CPU copies: what an asynchronous save writes while
    training goes on changing the originals in place. Tensors of ``reuse`` (the previous
    snapshot, already written) are copied into where shapes and dtypes match: refilling memory
    costs a memcpy, allocating it fresh several times that (page faults), and the copy is the
    training stall."""
    if isinstance(obj, StateShard):  # a sharded optimizer's range: copy what it carries
        old_local = reuse.local if isinstance(reuse, StateShard) else None
        return StateShard(snapshot(obj.local, old_local), obj.shape[0], obj.offset)
    if isinstance(obj, torch.Tensor):
        source = obj.detach()
        if (
            type(obj) is torch.Tensor
            and type(reuse) is torch.Tensor
            and reuse.shape == obj.shape
            and reuse.dtype == obj.dtype
        ):
            return reuse.copy_(source)
        return source.to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return type(obj)((k, snapshot(v, old.get(k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        same = isinstance(reuse, (list, tuple)) and len(reuse) == len(obj)
        return type(obj)(snapshot(v, reuse[i] if same else None) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def mismatches(template: dict[str, Any], metadata: Metadata) -> list[str]:
    """How the checkpoint's contents differ from what the live objects need (different model,
    optimizer or settings), one line per key, at most a dozen."""
    flat, _ = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    lines = []
    for key, value in flat.items():
        meta = saved.get(key)
        if meta is None:
            lines.append(f"'{key}' is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                lines.append(f"'{key}' is not a tensor in the checkpoint")
            elif tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
                lines.append(
                    f"'{key}': checkpoint has {tuple(meta.size)} {meta.properties.dtype}, "
                    f"the live tensor is {tuple(value.shape)} {value.dtype}"
                )
    lines += [f"'{k}' is in the checkpoint, not in the model" for k in saved if _extra(k, flat)]
    return lines[:12] + ([f"... {len(lines) - 12} more"] if len(lines) > 12 else [])


_OTHER_RANKS = re.compile(r"\.rank\d+(\.|$)")  # PowerSGD's error.rank<r>, torch_hook.rank<r>


def _extra(key: str, flat: dict[str, Any]) -> bool:
    """A saved key that loading would drop: the model's, or the compression state's (a
    PowerSGD checkpoint resumed without PowerSGD would lose its error feedback); the other
    ranks' own compression state (PowerSGD's error buffers) belongs to them."""
    if key in flat or (key.startswith("gradsync.comm.") and _OTHER_RANKS.search(key)):
        return False
    return key.startswith(("model.", "gradsync.comm."))


def refuse_resize(
    path: Any, saved_world: int, world: int, metadata: Metadata, sampler: Any
) -> None:
    """Raise ``CheckpointError`` (on every rank alike) if checkpoint ``path``, saved by
    ``saved_world`` ranks, holds state that cannot move to ``world`` ranks."""
    why = []
    if any(k.startswith("gradsync.comm.") for k in metadata.state_dict_metadata):
        why.append(
            "it holds compression state (PowerSGD's error feedback and matrices), which is "
            "each rank's own"
        )
    if sampler is not None and not getattr(sampler, "world_size_independent", False):
        why.append(
            f"the sampler ({type(sampler).__name__}) keeps a position per rank, and each rank's "
            "share of an epoch depends on the world size: use gradsync.data.GlobalBatchSampler, "
            "whose position is the global step"
        )
    if why:
        raise CheckpointError(
            f"{path} was saved by {saved_world} ranks and cannot continue on {world}: "
            + "; ".join(why)
            + f". Resume with {saved_world} ranks; nothing was loaded"
        )
