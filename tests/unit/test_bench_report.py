"""The arithmetic behind ``gradsync bench`` reports: overlap efficiency, ring bound, bus bandwidth.

No process group, no network: numbers chosen so the expected values can be checked by hand.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.bench import plots, report, steptime
from gradsync.bench.steptime import FORWARD_AND_STEP
from gradsync.testing.netns import PAYLOAD_FRACTION


def test_overlap_efficiency_spans_no_overlap_to_limit() -> None:
    # compute 0.6 s, comm 0.4 s: no overlap 1.0 s, limit 0.6 s, ideal saving 0.4 s.
    assert report.overlap_efficiency(1.0, 0.6, 0.4) == pytest.approx(0.0)
    assert report.overlap_efficiency(0.6, 0.6, 0.4) == pytest.approx(1.0)
    assert report.overlap_efficiency(0.8, 0.6, 0.4) == pytest.approx(0.5)
    # Slower than compute then comm one after the other: negative, not clipped.
    assert report.overlap_efficiency(1.2, 0.6, 0.4) == pytest.approx(-0.5)
    # Symmetric in which side dominates: comm-bound steps use the same formula.
    assert report.overlap_efficiency(0.7, 0.4, 0.6) == pytest.approx(0.75)


def test_the_limit_keeps_the_forward_and_the_optimizer_step_out_of_the_overlap() -> None:
    # compute 0.6 s of which 0.2 s forward and step, comm 0.5 s: the backward (0.4 s) hides at
    # most 0.4 s of it, so no step is under 0.7 s (max(compute, comm) would say 0.6 s).
    assert report.step_limit(0.6, 0.5, 0.2) == pytest.approx(0.7)
    assert report.step_limit(0.6, 0.5) == pytest.approx(0.6)
    assert report.step_limit(0.6, 0.3, 0.2) == pytest.approx(0.6)  # compute-bound: compute
    assert report.overlap_efficiency(0.7, 0.6, 0.5, 0.2) == pytest.approx(1.0)
    assert report.overlap_efficiency(0.9, 0.6, 0.5, 0.2) == pytest.approx(0.5)
    result = fake_result(1000.0)
    result["step_s"][FORWARD_AND_STEP] = [0.3, 0.3, 0.3]  # comm 0.4 s: limit 0.3 + 0.4
    rows = {r.name: r for r in report.variant_rows(result)}
    assert rows["gradsync default"].limit == pytest.approx(0.7)
    assert rows["gradsync default"].efficiency == pytest.approx(1.0)
    numbers = dict((what, text) for what, _, text in report.targets(result))
    text = numbers["gradsync default <= 0.85x torch DDP default (round by round)"]
    assert text.endswith("no step on this link under 0.875x)"), text  # 0.7 s of torch's 0.8 s
    text = numbers["gradsync auto <= 0.85x torch DDP default (round by round)"]
    assert text.endswith("under 0.875x)"), text  # no replay of its own: the one flat call's


def test_overlap_efficiency_is_undefined_without_communication() -> None:
    assert report.overlap_efficiency(0.5, 0.5, 0.0) is None
    assert report.overlap_efficiency(0.5, 0.0, 0.5) is None


def test_ring_factor_bound_and_bus_bandwidth() -> None:
    assert report.ring_factor(1) == 0.0
    assert report.ring_factor(2) == 1.0
    assert report.ring_factor(4) == 1.5
    with pytest.raises(ValueError):
        report.ring_factor(0)
    # 1000 Mbit/s of frames carries 125 MB/s x 1448/1514 of TCP payload.
    payload = report.payload_rate(1000)
    assert payload == pytest.approx(125e6 * PAYLOAD_FRACTION)
    assert payload == pytest.approx(119.55e6, rel=1e-3)
    # 2 ranks: each link direction carries the whole tensor once.
    nbytes = 64 * 2**20
    assert report.ring_bound_s(nbytes, 2, payload) == pytest.approx(nbytes / payload)
    assert report.ring_bound_s(nbytes, 4, payload) == pytest.approx(1.5 * nbytes / payload)
    # A transfer at exactly the bound has a bus bandwidth equal to the payload rate.
    t = report.ring_bound_s(nbytes, 4, payload)
    assert report.bus_bandwidth(nbytes, 4, t) == pytest.approx(payload)
    assert report.bus_bandwidth(100e6, 2, 1.0) == pytest.approx(100e6)


def test_percentile_interpolates() -> None:
    assert report.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 25) == pytest.approx(1.75)
    assert report.percentile([5.0], 75) == 5.0


def fake_result(rate_mbit: float | None) -> dict[str, Any]:
    """A results dict shaped like the worker's, with round numbers."""
    names = [
        ("average_gradients", "naive", 25.0),
        ("gradsync cap 0 MB (per parameter)", "gradsync", 0.0),
        ("gradsync default", "gradsync", "default"),
        ("gradsync scaled", "gradsync", "scaled"),
        ("gradsync cap 25 MB", "gradsync", 25.0),
        ("gradsync one bucket", "gradsync", math.inf),
        ("gradsync bucket_cap_mb='auto'", "gradsync_auto", None),
        ("torch DDP default", "torch_ddp", 25.0),
        ("compute only (local)", "local", 25.0),
    ]
    step = {
        "average_gradients": [1.1, 1.0, 1.2],
        "gradsync cap 0 MB (per parameter)": [0.95, 0.9, 0.9],
        "gradsync default": [0.7, 0.8, 0.7],
        "gradsync scaled": [0.75, 0.75, 0.75],
        "gradsync cap 25 MB": [0.69, 0.69, 0.69],
        "gradsync one bucket": [1.0, 1.0, 1.0],
        "gradsync bucket_cap_mb='auto'": [0.72, 0.72, 0.72],
        "torch DDP default": [0.8, 0.8, 0.9],
        "compute only (local)": [0.6, 0.6, 0.6],
    }
    comm = {n: [0.4, 0.4, 0.4] for n, k, _ in names if k not in ("local", "gradsync_auto")}
    comm["flat (all gradient bytes, 1 call)"] = [0.4, 0.4, 0.4]
    return {
        "label": "test setting",
        "world": 2,
        "backend": "gloo",
        "omp_threads": 1,
        "num_parameters": 12_000_000,
        "dtype": "float32",
        "grad_bytes": 48_000_000,
        "rate_mbit": rate_mbit,
        "config": {"n_layer": 4, "n_embd": 512, "batch_per_rank": 4, "block_size": 64}
        | {"rounds": 3, "warmup": 1},
        "variants": [{"name": n, "kind": k, "bucket_cap_mb": c} for n, k, c in names],
        "step_s": step,
        "comm_s": comm,
        "comm_bytes": {n: [48_000_000] for n in comm},
        "busbw": [{"size_bytes": 64 * 2**20, "times_s": [0.60, 0.58, 0.59]}],
    }


def test_variant_rows_and_targets_from_a_result() -> None:
    result = fake_result(1000.0)
    rows = {r.name: r for r in report.variant_rows(result)}
    default = rows["gradsync default"]
    assert default.step == pytest.approx(0.7)
    assert default.ratio_to_torch == pytest.approx(0.7 / 0.8)
    # Round by round: 0.7/0.8, 0.8/0.8, 0.7/0.9, whose median is 0.875 too.
    assert default.paired_to_torch == pytest.approx(0.875)
    assert (default.limit, default.no_overlap) == (pytest.approx(0.6), pytest.approx(1.0))
    assert default.efficiency == pytest.approx(0.75)
    assert rows["torch DDP default"].efficiency == pytest.approx(0.5)
    assert rows["compute only (local)"].efficiency is None
    assert rows["compute only (local)"].comm == 0.0

    verdicts = {what: met for what, met, _ in report.targets(result)}
    assert verdicts["gradsync default step <= 1.0x torch DDP default (round by round)"] is True
    fastest = next(k for k in verdicts if k.startswith("fastest gradsync"))
    assert verdicts[fastest] is True  # 0.775 (cap 25 MB, the fastest) > 0.5
    (bw,) = report.busbw_rows(result)
    # Ring bound 67.1 MB / 119.55 MB/s = 0.561 s against a 0.59 s median: 0.951 of the bound.
    assert bw.ratio == pytest.approx(0.951, abs=1e-3)
    busbw_target = next(k for k in verdicts if k.startswith("all-reduce bus bandwidth"))
    assert verdicts[busbw_target] is True
    # The default: 0.7 / 0.8 = 0.875x torch (> 0.85), 0.7 / 0.69 = 1.014x the fastest fixed
    # cap (<= 1.03). auto: 0.9x torch, 0.72 / 0.69 = 1.043x the fastest cap (> 1.03). The
    # default is no fixed cap: were it one, auto would be within 3 % of it (1.029x).
    assert verdicts["gradsync default <= 0.85x torch DDP default (round by round)"] is False
    assert verdicts["gradsync default within 3% of the fastest fixed cap"] is True
    assert verdicts["gradsync auto <= 0.85x torch DDP default (round by round)"] is False
    assert verdicts["gradsync auto within 3% of the fastest fixed cap"] is False
    plans = {"auto_plan": "X", "default_plan": "Y"}
    details = {what: detail for what, _, detail in report.targets(result | plans)}
    assert details["gradsync auto within 3% of the fastest fixed cap"].endswith("; X")
    assert details["gradsync default within 3% of the fastest fixed cap"] == (
        "1.014x gradsync cap 25 MB; Y"
    )
    # On loopback (no link rate) the slow link's bucket targets are not judged.
    loopback = {what for what, _, _ in report.targets(fake_result(None))}
    assert not any("0.85x" in what or "3%" in what for what in loopback)


def test_loopback_has_no_ring_bound_and_reports_render(tmp_path: Path) -> None:
    loop = fake_result(None) | {"label": "loopback"}
    (bw,) = report.busbw_rows(loop)
    assert bw.ring_bound is None and bw.ratio is None
    assert not any(w.startswith("all-reduce") for w, _, _ in report.targets(loop))
    text = report.markdown_report([fake_result(1000.0), loop], ["a.png"])
    assert "| gradsync default | 700 |" and "| gradsync scaled | 750 |" in text
    assert "0.75" in text and "![a.png](a.png)" in text
    plots.plot_step_vs_bucket([fake_result(1000.0), loop], str(tmp_path / "a.png"))
    plots.plot_breakdown([fake_result(1000.0), loop], str(tmp_path / "b.png"))
    assert (tmp_path / "a.png").stat().st_size > 1000
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_bench_caps_are_fixed_caps() -> None:
    from gradsync.bench import worker

    assert worker.parse_cap("one") == worker.parse_cap("none") == math.inf
    assert worker.parse_cap("5") == 5.0
    for word in ("scaled", "auto"):  # both run in every bench, in rows of their own
        with pytest.raises(argparse.ArgumentTypeError, match="fixed caps"):
            worker.parse_cap(word)


def test_bench_without_matplotlib_stops_before_measuring_naming_the_install_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plots need matplotlib (the `bench` extra): checked first, so a run without it ends
    at once with the install line instead of dying after minutes of measurement."""
    from gradsync.bench import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    measured: list[str] = []
    monkeypatch.setattr(cli, "_run_loopback", lambda *a: measured.append("loopback"))
    args = argparse.Namespace(out=str(tmp_path / "bench"), where="loopback", trace=False)
    assert cli.run(args) == 2
    assert "pip install 'gradsync[bench]'" in capsys.readouterr().err
    assert not measured and not (tmp_path / "bench").exists()


def test_paired_ratio_cancels_a_slow_phase_that_hits_both_sides() -> None:
    # Rounds 3-5 ran at twice the time on a loaded machine, except the variant's step of
    # round 3, which ran before the load came. The variant is 0.95x torch in every round
    # whose load both shared: round by round that is the median, while the medians take the
    # slow phase on one side only (3 of 5 rounds against 2) and say 0.475x.
    base = [1.0, 1.0, 2.0, 2.0, 2.0]
    times = [0.95, 0.95, 0.95, 1.9, 1.9]
    assert statistics.median(times) / statistics.median(base) == pytest.approx(0.475)
    assert report.paired_ratio(times, base) == pytest.approx(0.95)
    with pytest.raises(ValueError, match="paired rounds"):
        report.paired_ratio(times, base[:4])


def test_each_round_has_its_own_order_the_same_on_every_rank() -> None:
    names = [f"v{i}" for i in range(6)]
    orders = [steptime.round_order(names, r) for r in range(20)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [steptime.round_order(names, r) for r in range(20)]  # what ranks agree on
    # Unlike a rotation, who runs just before v0 changes from round to round.
    before = {o[o.index("v0") - 1] for o in orders if o.index("v0") > 0}
    assert len(before) >= 4


def test_the_torch_baseline_is_built_with_torchs_own_defaults(one_rank) -> None:  # type: ignore[no-untyped-def]
    # torch DDP closes its first bucket at 1 MiB only when bucket_cap_mb is left out; a bench
    # that passed its default value (25) would time a plan with one all-reduce fewer.
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from gradsync.bench.variant import torch_ddp_caps
    from gradsync.bench.worker import bench_variants

    torch_variants = [v for v in bench_variants(formats=True) if v.kind.startswith("torch_ddp")]
    model = torch.nn.Linear(4, 4)

    def builds_torchs_default(cap: float | str | None) -> bool:
        return bool(TorchDDP(model, **torch_ddp_caps(cap)).bucket_bytes_cap_default)

    defaults = [v.name for v in torch_variants if builds_torchs_default(v.bucket_cap_mb)]
    assert defaults == ["torch DDP default", "torch DDP + bf16_compress_hook"], defaults


def fake_host_result(world: int) -> dict[str, Any]:
    """A ``gradsync bench --where host`` result at one world size, with round numbers."""
    from gradsync.bench import hostbound

    step = {
        "torch DDP default": [2.0e-3, 2.0e-3, 4.0e-3],
        "gradsync default": [2.2e-3, 2.4e-3, 4.2e-3],
        "gradsync timeline off (straggler_every=0)": [2.2e-3, 2.2e-3, 4.0e-3],
        "compute only (local)": [1.0e-3, 1.0e-3, 2.0e-3],
    }
    return {
        "label": f"host-bound, {world} ranks",
        "world": world,
        "backend": "gloo",
        "omp_threads": 1,
        "torch": "2.13.0+cpu",
        "num_tensors": 300,
        "num_parameters": 10_800,
        "config": {"num_layers": 150, "width": 8, "batch_per_rank": 4}
        | {"steps_per_round": 10, "rounds": 3, "warmup": 1},
        "variants": [asdict(v) for v in hostbound.HOST_VARIANTS],
        "all_reduces": {"torch DDP default": 1, "gradsync default": 1},
        "step_s": step,
    }


def test_host_bound_rows_ratios_and_targets() -> None:
    from gradsync.bench import host_report

    result = fake_host_result(2)
    rows = {r.name: r for r in host_report.host_rows(result)}
    default = rows["gradsync default"]
    # Round by round 1.1, 1.2, 1.05: median 1.1; medians 2.4 / 2.0 = 1.2.
    assert default.paired_to_torch == pytest.approx(1.1)
    assert default.ratio_to_torch == pytest.approx(1.2)
    assert default.over_local == pytest.approx(1.4e-3)
    # Timeline on / off round by round 1.0, 1.0909, 1.05: median 1.05; medians 2.4 / 2.2.
    assert host_report.timeline_cost(result) == (pytest.approx(1.05), pytest.approx(2.4 / 2.2))
    # gradsync costs 1.4 ms over the module's 1.0, torch DDP 1.0 ms: 1.4x torch's cost.
    assert host_report.sync_cost_ratio(result) == pytest.approx(1.4)
    verdicts = {what: met for what, met, _ in host_report.host_targets(result)}
    assert verdicts == {
        "gradsync default step <= 1.00x torch DDP default (round by round)": False,
        "the step timeline <= 1.01x of gradsync's step (default over straggler_every=0, "
        "round by round)": False,
    }
    faster = fake_host_result(1)
    faster["step_s"]["gradsync default"] = [1.9e-3, 2.0e-3, 3.8e-3]  # 0.95x torch, 0.91x off
    assert all(met for _, met, _ in host_report.host_targets(faster))
    text = host_report.markdown_report([faster, result])
    assert "| 1 | 2.00 | 2.00 | 2.20 | 1.00 | 0.950 | 0.909 | 1.00 |" in text, text
    assert "| 2 | 2.00 | 2.40 | 2.20 | 1.00 | 1.100 | 1.050 | 1.40 |" in text, text
    assert "| gradsync default | 2.40 | 2.30-3.30 | 1.200 | 1.100 | 1.40 | 1 |" in text, text
    assert "| compute only (local) | 1.00 | 1.00-1.50 | 0.500 | 0.500 | 0.00 | - |" in text
    assert "- host-bound, 2 ranks: gradsync default step <= 1.00x torch DDP default" in text
    # Round ratios 1.1, 1.2, 1.05: quartiles 1.075 and 1.15.
    assert "**MISSED** (1.100x, rounds 1.075-1.150; medians: 1.200x)" in text, text


def test_host_bound_rank_times_every_variant_in_process(one_rank) -> None:  # type: ignore[no-untyped-def]
    # The rank body on a world of one in this process: the wiring, not the numbers.
    from gradsync.bench import hostbound

    cfg = hostbound.HostBoundConfig(num_layers=3, steps_per_round=2, warmup=0, rounds=2)
    result = hostbound.host_rank(0, 1, cfg)
    assert result is not None
    names = [v.name for v in hostbound.HOST_VARIANTS]
    assert list(result["step_s"]) == names
    assert all(len(t) == 2 and min(t) > 0 for t in result["step_s"].values())
    assert (result["num_tensors"], result["num_parameters"]) == (6, 3 * (64 + 8))
    calls = result["all_reduces"]
    assert calls["torch DDP default"] == calls["gradsync default"] == 1
    assert calls["compute only (local)"] == 0
    off = next(v for v in result["variants"] if v["name"] == hostbound.TIMELINE_OFF_NAME)
    assert off["straggler_every"] == 0 and result["gradsync_defaults"]["straggler_every"] == 10


def test_host_time_finds_every_phase_it_times_and_renders(one_rank, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # benchmarks/host_time.py times gradsync's phases by wrapping methods of one wrapper's
    # objects (its POINTS): a change to the library that moves one makes it say "not found"
    # and leaves that time to a coarser phase. Here every point must be found and called.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import host_time

    args = argparse.Namespace(layers=3, width=8, batch=4, steps_per_round=2, rounds=2)
    result = host_time.measure(argparse.Namespace(**vars(args), warmup=0, profile=True))
    assert result is not None and result["missing"] == []
    calls = result["calls_per_step"]["gradsync, instrumented"]
    for phase, _ in host_time.POINTS:
        assert calls[phase] >= 1, (phase, calls)
    assert calls["hooks, per parameter"] == 6  # one per parameter tensor
    text = host_time.report(result)
    assert "| reduction start: buffers laid out again | 1 |" in text, text
    assert "| torch DDP |" in text and "gradsync::bucket_copy_in" in text, text
