"""The model check at construction: every rank must hold the same parameters, buffers and
settings before rank 0's state is broadcast to them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from gradsync.ddp.checks.diagnostics import check_replicas
from gradsync.ddp.options import SyncOptions
from gradsync.errors import ModelMismatchError, UsageError
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import local, placement_text

Row = tuple[str, str, tuple[int, ...], str, bool, str]


def describe(
    named_params: Iterable[tuple[str, torch.Tensor]],
    named_buffers: Iterable[tuple[str, torch.Tensor]],
) -> list[Row]:
    """(kind, name, local shape, dtype, requires_grad, placements) of every parameter and
    buffer, in order. For a DTensor the shape is its local shard's and the placements say how
    it is distributed ('' for a plain tensor): data-parallel ranks must agree on both."""
    rows = [
        ("parameter", n, tuple(local(p).shape), str(p.dtype), p.requires_grad, placement_text(p))
        for n, p in named_params
    ]
    rows += [
        ("buffer", n, tuple(local(b).shape), str(b.dtype), False, placement_text(b))
        for n, b in named_buffers
    ]
    return rows


def check_same_model(
    rows: list[Row],
    settings: dict[str, Any],
    deadline: Deadline,
) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless all ranks hold the same model and
    settings.

    One gather of the description under the deadline; every rank then runs the same
    comparison on the same data, so every rank raises the same error and none is left waiting.
    """
    world = deadline.world_size
    gathered = deadline.gather_objects((rows, settings), WHAT)
    _raise_refusals(gathered)
    ref_rows, ref_settings = gathered[0]
    for r in range(1, world):
        other_rows, other_settings = gathered[r]
        for key in ref_settings:
            if other_settings.get(key) != ref_settings[key]:
                raise ModelMismatchError(
                    f"DistributedDataParallel setting {key!r} differs across ranks: "
                    f"rank 0 has {ref_settings[key]!r}, rank {r} has {other_settings.get(key)!r}"
                )
        for a, b in zip(ref_rows, other_rows, strict=False):
            if a != b:
                raise ModelMismatchError(
                    f"ranks hold different models; first difference at {a[0]} "
                    f"'{a[1]}' (rank 0: {_fmt(a)}) vs {b[0]} '{b[1]}' (rank {r}: {_fmt(b)})"
                )
        if len(ref_rows) != len(other_rows):
            longer, who = (ref_rows, 0) if len(ref_rows) > len(other_rows) else (other_rows, r)
            extra = longer[min(len(ref_rows), len(other_rows))]
            raise ModelMismatchError(
                f"ranks hold different models; {extra[0]} '{extra[1]}' exists on rank "
                f"{who} only (rank 0 has {len(ref_rows)} tensors, rank {r} has {len(other_rows)})"
            )


WHAT = "the model check at construction"


class Refusal(NamedTuple):
    """What a rank that refused its arguments sends in place of its model description."""

    message: str


def refuse_everywhere(error: UsageError, deadline: Deadline) -> NoReturn:
    """Raise ``error`` of this rank on every rank: it takes part in the model check's gather
    (the same collectives as :func:`check_same_model`) with a :class:`Refusal`, so a peer whose
    own arguments were fine raises too instead of waiting for this rank until the deadline."""
    _raise_refusals(deadline.gather_objects(Refusal(str(error).removeprefix("gradsync: ")), WHAT))
    raise AssertionError("unreachable: this rank's refusal is in the gather")


def _raise_refusals(gathered: list[Any]) -> None:
    """Raise the refusals of every rank that sent one. The first line names the first such
    rank and the setting at fault (logs, exception summaries and test reports show one line);
    every refusing rank's whole message follows."""
    refused = [(r, g.message) for r, g in enumerate(gathered) if isinstance(g, Refusal)]
    if not refused:
        return
    rank, message = refused[0]
    others = [str(r) for r, _ in refused[1:]]
    also = f" (and on rank(s) {', '.join(others)})" if others else ""
    first = f"DistributedDataParallel refused its arguments{also} on rank {rank}: {message}"
    if not others and "\n" not in message:
        raise UsageError(first)
    lines = [f"  rank {r}: {m}" for r, m in refused]
    raise UsageError(f"{first.splitlines()[0]}\n" + "\n".join(lines))


def _fmt(row: Row) -> str:
    _, _, shape, dtype, requires_grad, placements = row
    where = f", placements ({placements})" if placements else ""
    return f"shape {list(shape)}, {dtype}, requires_grad={requires_grad}{where}"


def make_replicas_equal(
    named_params: Sequence[tuple[str, torch.Tensor]],
    named_buffers: Sequence[tuple[str, torch.Tensor]],
    options: SyncOptions,
    settings: dict[str, Any],
    deadline: Deadline,
    known_same: bool = False,
) -> None:
    """Check that every rank holds the same model and ``settings``, then copy rank 0's state
    (with ``options.init_sync=False``: check that the parameters already are rank 0's).
    ``known_same``: the ranks were checked together before (survivors regrouping), so only
    the parameters are; the model check is a gather of every rank's description."""
    if not known_same:
        check_same_model(describe(named_params, named_buffers), settings, deadline)
    sent = [p.data for _, p in named_params] if options.init_sync else []
    sent += [b for _, b in named_buffers] if options.init_sync_buffers else []
    if sent:
        deadline.broadcast(sent, 0, "the initial broadcast of rank 0's parameters and buffers")
    if not options.init_sync:
        hint = "init_sync=False needs equal replicas: seed the model the same on every rank"
        check_replicas(list(named_params), deadline, hint)
