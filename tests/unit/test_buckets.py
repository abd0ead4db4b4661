"""Bucket planning is pure, and a bucket hands out its results without any process group."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.comm.formats import wire_bytes
from gradsync.ddp import buckets
from gradsync.ddp.buckets import Bucket
from gradsync.ddp.compat.state_keys import strip_prefixes
from gradsync.ddp.plan import (
    MB,
    cap_to_bytes,
    parse_cap,
    plan_buckets,
    resolve_cap,
    scaled_cap_mb,
)

F32 = torch.float32


def members(specs):  # type: ignore[no-untyped-def]
    return [list(s.param_indices) for s in specs]


def test_cap_zero_gives_one_bucket_per_parameter_in_reverse_order() -> None:
    specs = plan_buckets([(10, F32), (20, F32), (30, F32)], 0)
    assert members(specs) == [[2], [1], [0]]


def test_positive_cap_closes_a_bucket_once_it_holds_the_cap() -> None:
    # 4-byte elements: 10, 20, 30, 5 elements = 40, 80, 120, 20 bytes; cap 130 bytes.
    specs = plan_buckets([(10, F32), (20, F32), (30, F32), (5, F32)], 130)
    assert members(specs) == [[3, 2], [1, 0]]  # 140 bytes: past the cap by its last parameter
    assert [s.offsets for s in specs] == [(0, 5), (0, 20)]
    assert [s.numel for s in specs] == [35, 30]


def test_parameter_larger_than_cap_closes_the_bucket_it_joins() -> None:
    specs = plan_buckets([(1, F32), (1000, F32), (1, F32)], 16)
    assert members(specs) == [[2, 1], [0]]


def _torch_plan(params: list[tuple[int, torch.dtype]], cap: int, first: int | None) -> list:
    """torch DDP's buckets for ``params`` when gradients arrive in reverse registration order:
    what its rebuild computes after the first iteration."""
    order = list(reversed(range(len(params))))
    tensors = [torch.empty(params[i][0], dtype=params[i][1]) for i in order]
    limits = [cap] if first is None else [first, cap]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(params), order
    )
    return [list(b) for b in buckets]


def test_the_plan_is_torch_ddps() -> None:
    rng = random.Random(0)
    for _ in range(300):
        dtypes = rng.choice([[F32], [F32, torch.float64]])
        params = [(rng.choice([1, 3, 10, 25, 100, 400]), rng.choice(dtypes)) for _ in range(12)]
        cap = rng.choice([0, 8, 40, 100, 400, 1000])
        first = rng.choice([None, 4, 50, cap])
        first = None if first is None else min(first, cap)
        ours = members(plan_buckets(params, cap, first))
        torchs = _torch_plan(params, cap, first)
        if len(dtypes) == 1:
            assert ours == torchs, (params, cap, first)
        else:  # torch closes the buckets left open at the end in hash-map order
            assert sorted(ours) == sorted(torchs), (params, cap, first)


def test_none_is_one_bucket_per_dtype() -> None:
    specs = plan_buckets([(3, F32), (4, torch.bfloat16), (5, F32)], None)
    assert sorted(members(specs)) == [[1], [2, 0]]
    assert {s.dtype for s in specs} == {F32, torch.bfloat16}


def test_mixed_dtypes_never_share_a_bucket() -> None:
    params = [(8, F32), (8, torch.float64), (8, F32), (8, torch.float64)]
    for cap in (0, 64, 10 * MB, None):
        for spec in plan_buckets(params, cap):
            assert {params[i][1] for i in spec.param_indices} == {spec.dtype}


def test_every_parameter_is_planned_exactly_once() -> None:
    params = [(n, F32) for n in (7, 1, 300, 2, 2, 64, 9)]
    for cap in (0, 8, 40, 1000, None):
        planned = sorted(i for s in plan_buckets(params, cap) for i in s.param_indices)
        assert planned == list(range(len(params)))


def test_cap_units_and_validation() -> None:
    assert cap_to_bytes(25.0) == 25 * 1024 * 1024
    assert cap_to_bytes(None) is None and cap_to_bytes(math.inf) is None
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        cap_to_bytes(-1)


def test_scaled_cap_is_an_eighth_of_the_gradients_between_1_and_25_mib() -> None:
    assert scaled_cap_mb(0) == scaled_cap_mb(8 * MB) == 1.0
    assert scaled_cap_mb(50 * MB) == 6.25
    assert scaled_cap_mb(200 * MB) == scaled_cap_mb(10**12) == 25.0
    # Bytes, not elements: bf16 counts half as much as fp32; "auto" starts from the same plan.
    params = [(4 * MB, F32), (8 * MB, torch.bfloat16), (8 * MB, F32)]  # 16 + 16 + 32 MiB
    assert resolve_cap("scaled", params) == resolve_cap("auto", params) == 8.0
    assert resolve_cap(5.0, params) == 5.0 and resolve_cap(math.inf, params) == math.inf
    # None is torch DDP's meaning (the default), not "one bucket" (math.inf is that): torch's
    # 25 MiB where the ranks share one host, "scaled" across hosts or where that is not known.
    assert resolve_cap(None, params, hosts=1) == 25.0 == resolve_cap(None, [], hosts=1)
    assert resolve_cap(None, params, hosts=2) == resolve_cap(None, params) == 8.0
    assert resolve_cap("scaled", params, hosts=1) == 8.0  # a word asked for is kept
    # "auto" starts from the default, which is also where it goes back if its choice is slower
    assert resolve_cap("auto", params, hosts=1) == 25.0
    assert resolve_cap("auto", params, hosts=2) == resolve_cap(None, params, hosts=2) == 8.0
    # The 1 MiB floor is on the wire: bf16 (half the bytes) buckets hold at least 2 MiB;
    # PowerSGD's ~1/80 of the bytes keeps torch's 25 MiB however small the model.
    assert scaled_cap_mb(50 * MB, 25 * MB) == 6.25 and scaled_cap_mb(8 * MB, 4 * MB) == 2.0
    assert scaled_cap_mb(50 * MB, 50 * MB // 80) == 25.0
    assert resolve_cap("scaled", params, wire_bytes=2 * MB) == 25.0


@pytest.mark.parametrize("bad", ["fast", -1, float("nan"), -float("inf"), True])
def test_a_cap_that_is_none_of_the_choices_is_refused_naming_them(bad: object) -> None:
    with pytest.raises(gradsync.UsageError, match="bucket_cap_mb.*'scaled' or 'auto'"):
        resolve_cap(bad, [])  # type: ignore[arg-type]


def test_parse_cap() -> None:
    assert parse_cap("none") == parse_cap("inf") == math.inf  # one bucket
    assert parse_cap("6.5") == 6.5 and parse_cap("0") == 0.0
    assert parse_cap("Scaled") == "scaled" and parse_cap("auto") == "auto"
    for bad in ("-1", "fast", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'scaled' or 'auto', got '{bad}'"):
            parse_cap(bad)


def test_the_wrapper_defaults_to_torchs_cap_on_one_host(one_rank) -> None:  # type: ignore[no-untyped-def]
    # 16.25 MiB of fp32 gradients: on one host torch's 25 MiB, two buckets (the 1 MiB first one
    # and the rest); "scaled" (the default across hosts) makes 2.03 MiB buckets.
    model = nn.Sequential(
        *[nn.Linear(1024, 1024, bias=False) for _ in range(4)], nn.Linear(1024, 64)
    )
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    ddp = gradsync.DistributedDataParallel(model)
    assert ddp.bucket_cap_mb == 25.0 and len(ddp.bucket_specs) == 2
    scaled = gradsync.DistributedDataParallel(model, bucket_cap_mb="scaled")
    assert scaled.bucket_cap_mb == scaled_cap_mb(grad_bytes) == pytest.approx(2.0313, abs=1e-4)
    assert [list(s.param_indices) for s in scaled.bucket_specs] == [[5, 4, 3], [2], [1], [0]]
    named = list(model.named_parameters())
    sizes = [(p.numel(), p.dtype) for _, p in named]
    assert wire_bytes(None, named, sizes) == grad_bytes
    assert wire_bytes("bf16", named, sizes) == grad_bytes // 2
    # PowerSGD rank 4: P and Q of each 1024 x 1024 matrix (and of the 64 x 1024 one), the
    # bias exact; the scaled cap then stays at 25 MiB.
    psgd = gradsync.comm.PowerSGD(rank=4)
    assert wire_bytes(psgd, named, sizes) == 4 * (4 * 2048 * 4 + 1088 * 4 + 64)
    psgd_ddp = gradsync.DistributedDataParallel(model, compression=psgd, bucket_cap_mb="scaled")
    assert psgd_ddp.bucket_cap_mb == 25.0


def test_strip_prefixes() -> None:
    plain = {"a.weight": 1, "b": 2}
    assert strip_prefixes(plain) == plain
    assert strip_prefixes({f"module.{k}": v for k, v in plain.items()}) == plain
    assert strip_prefixes({f"module._orig_mod.{k}": v for k, v in plain.items()}) == plain
    mixed = {"module.a": 1, "b": 2}  # not every key prefixed: left alone
    assert strip_prefixes(mixed) == mixed


def test_first_bucket_cap_starts_communication_sooner() -> None:
    # 40-byte parameters, cap 100 bytes: the first bucket closes once it holds 50 bytes.
    specs = plan_buckets([(10, F32)] * 5, 100, first_cap_bytes=50)
    assert members(specs) == [[4, 3], [2, 1, 0]]
    # Each dtype's first bucket: a float64 parameter does not count as float32's first.
    mixed = [(10, F32), (10, F32), (10, F32), (10, torch.float64), (10, torch.float64)]
    assert members(plan_buckets(mixed, 100, first_cap_bytes=50)) == [[4], [2, 1], [3], [0]]
    # A first parameter already past first_cap_bytes goes alone; the cap still holds.
    specs = plan_buckets([(10, F32), (10, F32), (20, F32)], 100, first_cap_bytes=50)
    assert members(specs) == [[2], [1, 0]]
    # Without a positive cap there is no first bucket to close early.
    assert members(plan_buckets([(10, F32)] * 3, None, first_cap_bytes=50)) == [[2, 1, 0]]
    assert members(plan_buckets([(10, F32)] * 3, 0, first_cap_bytes=50)) == [[2], [1], [0]]


def test_strip_prefixes_keeps_a_models_own_module_prefix() -> None:
    # The model's only child is called `module`: its own keys start with "module.".
    own = {"module.weight", "module.bias"}
    mine = {k: 0 for k in own}
    assert strip_prefixes(mine, own) == mine
    assert strip_prefixes({f"module.{k}": 0 for k in own}, own) == mine  # saved from torch DDP
    assert strip_prefixes({f"_orig_mod.{k}": 0 for k in own}, own) == mine  # torch.compile
    plain = {"weight": 0, "bias": 0}
    assert strip_prefixes({f"module.{k}": 0 for k in plain}, plain.keys()) == plain


@pytest.fixture()
def hand_over_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets of these tests' few-element parameters hand their buffer over, as large ones do."""
    monkeypatch.setattr(buckets, "HAND_OVER_BYTES", 0)


def _summed_bucket(sizes: tuple[int, ...] = (3, 20, 5)) -> tuple[Bucket, torch.Tensor]:
    """A bucket whose gradients have been "summed" to 0, 1, 2, ...; and that buffer."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    (spec,) = plan_buckets([(p.numel(), p.dtype) for p in params], None)
    bucket = Bucket(spec, [params[i] for i in spec.param_indices])
    bucket.grads.copy_(torch.arange(float(spec.numel)))
    return bucket, bucket.buffer


def _is_view_of(grad: torch.Tensor | None, buffer: torch.Tensor, offset: int) -> bool:
    assert grad is not None
    at = buffer.data_ptr() + offset * buffer.element_size()
    return grad.untyped_storage().data_ptr() == buffer.data_ptr() and grad.data_ptr() == at


def test_results_hand_the_buffer_over_and_write_a_kept_gradient_in_place(
    hand_over_small: None,
) -> None:
    bucket, summed = _summed_bucket()
    offsets = bucket.spec.offsets
    kept = torch.full((bucket.params[1].numel(),), -1.0)
    bucket.params[1].grad = kept  # there before the window opened: the user may hold it
    copies = bucket.results([2, 2, 2])
    assert [(dst is kept, _is_view_of(src, summed, offsets[1])) for dst, src in copies] == [
        (True, True)
    ]  # written in place from the summed buffer, in the caller's batch
    for slot in (0, 2):  # no .grad: each becomes the summed buffer's view, no copy
        assert _is_view_of(bucket.params[slot].grad, summed, offsets[slot])
    assert bucket.views == [] and bucket.buffer.numel() == 0  # none until claim()
    del copies
    bucket.claim()  # the gradients still hold the summed buffer: new memory
    assert bucket.buffer.data_ptr() != summed.data_ptr()
    assert bucket.views[0].data_ptr() == bucket.buffer.data_ptr()
    assert bucket.tail.numel() == 0 and bucket.used_flags.numel() == 3
    bucket.grads.fill_(7.0)  # the next step cannot reach the gradients handed over
    for slot in (0, 2):
        o = offsets[slot]
        assert torch.equal(
            bucket.params[slot].grad, torch.arange(28.0)[o : o + bucket.numels[slot]]
        )


def test_a_buffer_no_gradient_refers_to_is_taken_back(hand_over_small: None) -> None:
    bucket, summed = _summed_bucket()
    bucket.results([1, 1, 1])
    for p in bucket.params:  # as zero_grad() does
        p.grad = None
    bucket.claim()
    assert bucket.buffer.data_ptr() == summed.data_ptr()  # the same memory, laid out again
    assert [v.data_ptr() for v in bucket.views] == [
        summed.data_ptr() + o * 4 for o in bucket.spec.offsets
    ]
    bucket.results([1, 1, 1])
    held = bucket.params[2].grad.view(-1)  # a view of a gradient, kept after zero_grad()
    for p in bucket.params:
        p.grad = None
    bucket.claim()
    assert bucket.buffer.data_ptr() != summed.data_ptr()  # would write into what is held
    assert held.data_ptr() == summed.data_ptr() + bucket.spec.offsets[2] * 4


def test_only_a_gradient_autograd_made_in_the_window_is_handed_over(hand_over_small: None) -> None:
    bucket, summed = _summed_bucket((4, 4, 4, 4))
    p = bucket.params
    p[0].grad = torch.zeros(4)  # there when the window opened: written in place
    bucket.open_window(training=True)
    p[1].grad = torch.zeros(4)  # made in the window, as autograd does after zero_grad()
    p[2].grad = torch.zeros(8)[::2]  # made in the window, but not contiguous like the view
    p[3].grad = torch.zeros(4, requires_grad=True)  # a graph: [Note: gradients with a graph]
    before = [q.grad for q in p]
    copies = bucket.results([1, 1, 1, 1])
    assert [dst for dst, _ in copies] == [before[0], before[2], before[3]]
    assert p[0].grad is before[0] and p[2].grad is before[2] and p[3].grad is before[3]
    assert _is_view_of(p[1].grad, summed, bucket.spec.offsets[1])


def test_a_gradient_unused_everywhere_is_left_as_it_was(hand_over_small: None) -> None:
    bucket, summed = _summed_bucket()
    bucket.open_window(training=True)
    assert bucket.results([2, 0, 2]) == []
    assert bucket.params[1].grad is None
    assert bucket.buffer.data_ptr() != summed.data_ptr()
    bucket, summed = _summed_bucket()
    assert bucket.results([0, 0, 0]) == []  # nothing handed over: the buffer stays
    assert bucket.buffer is summed


def test_a_bucket_of_small_parameters_copies_out_and_keeps_its_buffer() -> None:
    # Laying 300 views out again every step cost the host more than copying 300 small
    # gradients: a bucket hands over only where its parameters average HAND_OVER_BYTES.
    bucket, summed = _summed_bucket()
    assert not bucket.hands_over
    views = bucket.views
    kept = torch.full((bucket.params[1].numel(),), -1.0)
    bucket.params[1].grad = kept
    copies = bucket.results([2, 2, 2])
    assert [dst is kept for dst, _ in copies] == [True]
    for slot in (0, 2):  # used elsewhere, no .grad here: a gradient of its own, not a view
        grad = bucket.params[slot].grad
        assert grad is not None and grad.untyped_storage().data_ptr() != summed.data_ptr()
        o = bucket.spec.offsets[slot]
        assert torch.equal(grad, torch.arange(28.0)[o : o + bucket.numels[slot]])
    bucket.claim()
    assert bucket.buffer is summed and bucket.views is views  # nothing laid out again
    large = [torch.nn.Parameter(torch.zeros(buckets.HAND_OVER_BYTES // 4)) for _ in range(2)]
    (spec,) = plan_buckets([(p.numel(), p.dtype) for p in large], None)
    assert Bucket(spec, large).hands_over


def test_parameters_planned_last_fill_the_last_buckets_in_reverse_order() -> None:
    params = [(10, F32), (20, F32), (30, F32), (5, F32)]
    assert [s.param_indices for s in plan_buckets(params, 0, last=[3, 1])] == [
        (2,), (0,), (3,), (1,),
    ]  # fmt: skip
    # With a cap, no bucket holds parameters of both groups.
    assert [s.param_indices for s in plan_buckets(params, 200, last=[3])] == [(2, 1), (0,), (3,)]
    assert plan_buckets(params, 200, last=()) == plan_buckets(params, 200)
