"""bf16/fp16 on the wire with fp32 sums, at the level of the exchange itself (real gloo ranks).

``comm/exchange.py`` (gradsync's sends; the default on gloo) and
:func:`~gradsync.comm.compress.sum_with_fp32_accumulation` (the backend's all-to-all and
all-gather; the default elsewhere) on sizes that leave empty, short and padded chunks, with
segments of 4 and 32 elements (many messages per chunk) and the default 1 MiB, for world
sizes 1 to 4. Checked per case: every rank ends with the same bits, and both paths with the
same bits; every element is within [Note: the half-precision error bound] of the fp64 sum;
integer inputs whose sums the wire format holds exactly come back exact; every message sent
is of the wire dtype, with the bytes the docstrings state. Sums started before the last one
finished (as the hook runs them) give the bits of sums run one at a time. Two controls show
the bound is tight enough to tell the scheme from those it replaces: a ring all-reduce in
the wire dtype (each partial sum rounded at every hop) and an all-reduce in the wire dtype
(torch's compress hooks) exceed it from 3 ranks on.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats
from gradsync.comm.compress import (
    WIRE_DTYPES,
    naive_half_all_reduce,
    rounding_bound,
    sum_with_fp32_accumulation,
)
from gradsync.comm.exchange import DirectExchange
from gradsync.comm.ring import RingRunner, group_ring
from gradsync.testing.spawn import spawn

SEGMENT_BYTES = (8, 64, None)  # 4 and 32 two-byte elements per message; None: the default
CONTROLS = ("ring", "allreduce")  # schemes that round partial sums: expected to break the bound
LARGE = 100_000  # elements: enough that the controls' extra roundings show in some of them
KINDS = ("spread", "normal", "integer")


def _numels(world: int, segment: int | None) -> list[int]:
    small = sorted({0, 1, max(world - 1, 0), world + 1, 257, 1003})
    return small if segment is not None else [*small, LARGE]  # small segments: many messages


def _input(kind: str, numel: int, rank: int) -> torch.Tensor:
    """``spread``: magnitudes 1e-7 .. 1e2 (fp16's subnormal range included), both signs;
    ``normal``: standard normal; ``integer``: below 60, so a sum over 4 ranks is below 240,
    exact in bf16 (8 significant bits) and in fp16."""
    if kind == "integer":
        return (torch.arange(numel) * (rank + 3) % 60).float()
    g = torch.Generator().manual_seed(numel * 64 + rank)
    x = torch.randn(numel, generator=g)
    return x * 10 ** (torch.rand(numel, generator=g) * 9 - 7) if kind == "spread" else x


class _SendLog:
    """Records the dtype and size of every ``dist.isend`` (the wire), then calls through."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.dtype, int]] = []
        self._isend = dist.isend

    def __enter__(self) -> _SendLog:
        def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.sent.append((tensor.dtype, tensor.numel()))
            return self._isend(tensor, *args, **kwargs)

        dist.isend = isend  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.isend = self._isend


def _run(scheme: str, flat: torch.Tensor, dtype: torch.dtype, segment: int | None) -> int:
    """Sum ``flat`` in place by ``scheme``; the bytes it says it sent."""
    if scheme == "exchange":
        stats = CommStats()
        kw = {} if segment is None else {"segment_bytes": segment}
        return DirectExchange(group_ring(None), dtype, stats, **kw).sum(flat)
    if scheme == "collective":
        return sum_with_fp32_accumulation(flat, dtype, None)
    if scheme == "ring":  # the ring in the wire dtype: adds in fp32, rounds at every hop
        wire = flat.to(dtype)
        RingRunner(CommStats()).all_reduce(wire, group_ring(None))
        flat.copy_(wire)
        return 0
    naive_half_all_reduce(flat, dtype, None)
    return 0


def grid(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    cases = [("exchange", s) for s in SEGMENT_BYTES] + [("collective", None)]
    cases += [(c, None) for c in CONTROLS]
    for wire, dtype in WIRE_DTYPES.items():
        for scheme, segment in cases:
            for numel in _numels(world, segment):
                for kind in KINDS:
                    x = _input(kind, numel, rank)
                    flat = x.clone()
                    with _SendLog() as log:
                        sent = _run(scheme, flat, dtype, segment)
                    case = (wire, scheme, segment, numel, kind)
                    out.append({"case": case, "x": x, "got": flat, "sent": sent, "log": log.sent})
    return out


def in_flight(rank: int, world: int) -> dict[str, Any]:
    """Four sums started and finished as the hook does (the next one started before the last
    one finished), with exact tails; the same sums one at a time must give the same bits. The
    last input is bf16 (exact on the wire, added in fp32), its tail absent."""
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(n, generator=g) for n in (1003, 0, 257)]
    inputs.append(torch.randn(300, generator=g).to(torch.bfloat16))
    tails = [torch.tensor([1.0, rank + 1, 0.0, 2.0 * rank]) for _ in range(3)] + [None]
    exchange = DirectExchange(group_ring(None), torch.bfloat16, CommStats(), segment_bytes=64)
    flats = [x.clone() for x in inputs]
    outs = [None if t is None else t.clone() for t in tails]
    pending = [exchange.start(flats[0], outs[0]), exchange.start(flats[1], outs[1])]
    exchange.finish(pending[0])
    pending.append(exchange.start(flats[2], outs[2]))
    exchange.finish(pending[1])
    pending.append(exchange.start(flats[3], outs[3]))
    exchange.finish(pending[2])
    exchange.finish(pending[3])
    one_by_one = [x.clone() for x in inputs]
    for x, t in zip(one_by_one, [None if t is None else t.clone() for t in tails], strict=True):
        exchange.sum(x, t)
    return {"inputs": inputs, "flats": flats, "tails": outs, "one_by_one": one_by_one}


def _check_in_flight(results: list[dict[str, Any]], world: int) -> None:
    r0 = results[0]["in_flight"]
    for i, got in enumerate(r0["flats"]):
        assert torch.equal(got, r0["one_by_one"][i]), i  # no buffer shared between sums
        for r in results[1:]:
            assert torch.equal(r["in_flight"]["flats"][i], got), i
    for i in range(3):  # flags and tags: exact sums
        expected = torch.tensor([world, world * (world + 1) / 2, 0, world * (world - 1)])
        for r in results:
            assert torch.equal(r["in_flight"]["tails"][i], expected), (i, r["in_flight"]["tails"])
    # bf16 inputs are exact on the wire and sums of a few of them exact in fp32: the result is
    # the sum rounded once to bf16, bit for bit (adding in bf16 would round it N-1 times).
    exact = torch.stack([r["in_flight"]["inputs"][3].double() for r in results]).sum(0)
    assert torch.equal(r0["flats"][3], exact.to(torch.bfloat16))


def _check_case(results: list[list[dict[str, Any]]], i: int, world: int) -> float:
    """The asserts of case ``i``; returns the largest error / bound (for the controls)."""
    wire, scheme, _, numel, kind = results[0][i]["case"]
    dtype = WIRE_DTYPES[wire]
    got = results[0][i]["got"]
    for r in results[1:]:  # one result, bit for bit, on every rank
        assert torch.equal(r[i]["got"], got), results[0][i]["case"]
    xs = torch.stack([r[i]["x"].double() for r in results])
    exact = xs.sum(0)
    if scheme in CONTROLS:
        bound = rounding_bound(exact, xs.abs().sum(0), dtype, world)
        return float((got.double() - exact).abs().div(bound).max()) if numel else 0.0
    if world == 1:  # nothing travels, nothing is rounded
        assert torch.equal(got, results[0][i]["x"]) and results[0][i]["sent"] == 0
        return 0.0
    if kind == "integer":  # every partial sum representable: exact, wherever each chunk went
        assert torch.equal(got.double(), exact), results[0][i]["case"]
    else:
        err = (got.double() - exact).abs()
        bound = rounding_bound(exact, xs.abs().sum(0), dtype, world)
        assert (err <= bound).all(), (results[0][i]["case"], (err / bound).max().item())
        if numel >= 257 and kind == "spread":  # not vacuous: roundings of half an ulp happen
            assert (err / bound).max().item() > 0.25, results[0][i]["case"]
    expected = 2 * (world - 1) * math.ceil(numel / world) * 2  # 2-byte elements, 2 phases
    for r in results:
        assert r[i]["sent"] == expected, (results[0][i]["case"], r[i]["sent"], expected)
        if scheme == "exchange":  # the wire itself: only wire-dtype messages, those bytes
            assert {d for d, _ in r[i]["log"]} <= {dtype}, r[i]["log"]
            assert sum(n for _, n in r[i]["log"]) * 2 == expected
    return 0.0


def grid_and_in_flight(rank: int, world: int) -> dict[str, Any]:
    return {"grid": grid(rank, world), "in_flight": in_flight(rank, world)}


def _check_paths_agree(results: list[list[dict[str, Any]]]) -> None:
    """gloo's exchange and the collective path (NCCL's) give the same bits, at every segment
    size: each rounds every input once and adds the rounded copies in rank order in fp32.
    With two ranks so does gloo's own all-reduce in the wire dtype, which the bf16/fp16 hook
    runs then ([Note: two ranks, one half-precision all-reduce] in ``compress.py``)."""
    got = {r["case"]: r["got"] for r in results[0]}
    pair = len(results) == 2
    for (wire, scheme, segment, numel, kind), value in got.items():
        if scheme == "exchange":
            other = got[(wire, "collective", None, numel, kind)]
            assert torch.equal(value, other), (wire, segment, numel, kind)
            if pair and segment is None:
                other = got[(wire, "allreduce", None, numel, kind)]
                assert torch.equal(value, other), ("allreduce", wire, numel, kind)


@pytest.mark.parametrize("world", [2, 3, 4])  # a world of one sends nothing
@pytest.mark.timeout(240)
def test_half_precision_exchange(world: int) -> None:
    both = spawn(grid_and_in_flight, world, timeout_s=200)
    _check_in_flight(both, world)
    results = [b["grid"] for b in both]
    _check_paths_agree(results)
    worst: dict[tuple[str, str], float] = {}
    for i, r in enumerate(results[0]):
        wire, scheme, _, _, kind = r["case"]
        ratio = _check_case(results, i, world)
        if scheme in CONTROLS and kind != "integer":
            worst[(wire, scheme)] = max(worst.get((wire, scheme), 0.0), ratio)
    for (wire, scheme), ratio in worst.items():
        if world >= 3:  # with 2 ranks the only partial sum is the sum: one rounding
            # Each partial sum rounded on its way: some of the 100,000 normal elements end
            # beyond one rounding of each input and of the sum (measured: 1.27x to 1.37x the
            # bound at 3 ranks, 1.5x to 1.65x at 4).
            assert ratio > 1.0, (wire, scheme, ratio)
