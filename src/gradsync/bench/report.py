"""Turn ``gradsync bench`` results into numbers that mean something: tables, targets, plots.

A step's gradients can only be communicated while the backward makes them: not during the
forward, before they exist, nor during the optimizer step, which needs them all. So a step
takes no less than ``forward_and_step + max(backward, comm)`` (the limit; ``max(compute,
comm)`` in results without the forward's own time) and, with no overlap at all, ``compute +
comm``. Where a measured step falls between the two is the overlap efficiency::

    efficiency = (no_overlap - step) / (no_overlap - limit)

1.0: the step is at the limit; 0.0: nothing was hidden; negative: slower than doing the two one
after the other (contention for the CPUs, per-call latency). ``compute`` is the ``local``
variant (same model and batch, no communication), ``forward_and_step`` the same replica's step
without its backward (``FORWARD_AND_STEP`` in ``steptime.py``, ``backward = compute -
forward_and_step``) and ``comm`` the replay of each variant's own all-reduces with no compute,
all medians from the same interleaved rounds as the steps.

Bus bandwidth follows the NCCL-tests convention: a ring all-reduce of ``B`` bytes over ``N``
ranks moves ``2(N-1)/N * B`` bytes over every link direction, so it needs at least that many
bytes divided by the link's payload rate (the ring bound), and ``busbw = 2(N-1)/N * B / time``
can be compared with the link rate directly.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync.bench import wire
from gradsync.bench.steptime import FORWARD_AND_STEP
from gradsync.bench.variant import DEFAULT_CAP
from gradsync.testing.netns import PAYLOAD_FRACTION

MIB = 2**20
TARGET_BUSBW_BYTES = 64 * MIB  # the bus-bandwidth target is stated at 64 MB


def ring_factor(world: int) -> float:
    """Bytes a ring all-reduce sends over each link direction, per byte of the tensor."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return 2 * (world - 1) / world


def bus_bandwidth(nbytes: float, world: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s: comparable to a link's rate whatever the world size."""
    return ring_factor(world) * nbytes / seconds


def payload_rate(rate_mbit: float) -> float:
    """TCP payload bytes/s a link shaped to ``rate_mbit`` carries (tc counts frame bytes)."""
    return rate_mbit * 1e6 / 8 * PAYLOAD_FRACTION


def ring_bound_s(nbytes: float, world: int, payload_bytes_per_s: float) -> float:
    """Least time a ring all-reduce of ``nbytes`` can take on links of that payload rate."""
    return ring_factor(world) * nbytes / payload_bytes_per_s


def step_limit(compute: float, comm: float, forward_and_step: float | None = None) -> float:
    """The least a step can take: its forward and optimizer step, and the longer of its
    backward and its communication (``max(compute, comm)`` without ``forward_and_step``)."""
    fixed = min(forward_and_step or 0.0, compute)
    return fixed + max(compute - fixed, comm)


def overlap_efficiency(
    step: float, compute: float, comm: float, forward_and_step: float | None = None
) -> float | None:
    """Share of the ideal saving that ``step`` recovers; ``None`` when there is none to recover.

    With no communication (or no compute) limit and sum coincide and the ratio is undefined.
    """
    no_overlap = compute + comm
    limit = step_limit(compute, comm, forward_and_step)
    if no_overlap - limit <= 0:
        return None
    return (no_overlap - step) / (no_overlap - limit)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (no numpy needed for a handful)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of ``times[i] / base[i]``: two tasks' times from the same rounds
    of :func:`gradsync.bench.steptime.time_interleaved`, compared round by round. A slow phase
    of the shared machine that lasts a round or more slows both sides of a pair and cancels in
    its ratio, where a ratio of the two medians can still take a slow phase's rounds on one
    side only."""
    if len(times) != len(base) or not times:
        raise ValueError(f"paired rounds needed, got {len(times)} and {len(base)} times")
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


@dataclass(frozen=True)
class VariantRow:
    """One variant of one setting, every time in seconds (medians over the rounds)."""

    name: str
    kind: str
    bucket_cap_mb: float | str | None
    step: float
    step_p25: float
    step_p75: float
    ratio_to_torch: float
    """The step's median over torch DDP's median."""
    paired_to_torch: float
    """The median over rounds of the step over torch DDP's step in the same round
    (:func:`paired_ratio`): the ratio the targets read."""
    num_calls: int
    comm: float
    compute: float
    efficiency: float | None
    forward_and_step: float | None = None

    @property
    def limit(self) -> float:
        return step_limit(self.compute, self.comm, self.forward_and_step)

    @property
    def no_overlap(self) -> float:
        return self.compute + self.comm


@dataclass(frozen=True)
class BusbwRow:
    size_bytes: int
    seconds: float
    busbw: float
    payload_rate: float | None
    ring_bound: float | None

    @property
    def ratio(self) -> float | None:
        """Ring bound over measured time: 1.0 is as fast as the link allows."""
        return None if self.ring_bound is None else self.ring_bound / self.seconds


def _kind_name(result: dict[str, Any], kind: str) -> str:
    return next(v["name"] for v in result["variants"] if v["kind"] == kind)


def _compute_times(result: dict[str, Any]) -> tuple[float, float | None]:
    """Medians of compute alone and of its forward and optimizer step (``None`` in results
    without them)."""
    step_s = result["step_s"]
    compute = statistics.median(step_s[_kind_name(result, "local")])
    fixed = statistics.median(step_s[FORWARD_AND_STEP]) if FORWARD_AND_STEP in step_s else None
    return compute, fixed


def variant_rows(result: dict[str, Any]) -> list[VariantRow]:
    """Every variant's row; the ``local`` one (compute only) has ``comm == 0``."""
    step_s, comm_s = result["step_s"], result["comm_s"]
    compute, fixed = _compute_times(result)
    torch_times = step_s[_kind_name(result, "torch_ddp")]
    torch_step = statistics.median(torch_times)
    rows = []
    for v in result["variants"]:
        times = step_s[v["name"]]
        step = statistics.median(times)
        comm = statistics.median(comm_s[v["name"]]) if v["name"] in comm_s else 0.0
        rows.append(
            VariantRow(
                name=v["name"],
                kind=v["kind"],
                bucket_cap_mb=v["bucket_cap_mb"],
                step=step,
                step_p25=percentile(times, 25),
                step_p75=percentile(times, 75),
                ratio_to_torch=step / torch_step,
                paired_to_torch=paired_ratio(times, torch_times),
                num_calls=len(result["comm_bytes"].get(v["name"], [])),
                comm=comm,
                compute=compute,
                efficiency=overlap_efficiency(step, compute, comm, fixed) if comm > 0 else None,
                forward_and_step=fixed,
            )
        )
    return rows


def flat_comm(result: dict[str, Any]) -> tuple[str, float]:
    """(name, median seconds) of the single all-reduce of every gradient byte."""
    name = next(k for k in result["comm_s"] if k.startswith("flat"))
    return name, statistics.median(result["comm_s"][name])


def busbw_rows(result: dict[str, Any]) -> list[BusbwRow]:
    rate = result.get("rate_mbit")
    payload = payload_rate(rate) if rate else None
    world = result["world"]
    rows = []
    for b in result["busbw"]:
        seconds = statistics.median(b["times_s"])
        nbytes = b["size_bytes"]
        rows.append(
            BusbwRow(
                size_bytes=nbytes,
                seconds=seconds,
                busbw=bus_bandwidth(nbytes, world, seconds),
                payload_rate=payload,
                ring_bound=None if payload is None else ring_bound_s(nbytes, world, payload),
            )
        )
    return rows


def targets(result: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met?, the numbers) for one setting; ``None`` where it does not apply."""
    rows = variant_rows(result)
    default = next(r for r in rows if r.kind == "gradsync" and r.bucket_cap_mb == DEFAULT_CAP)
    torch_row = next(r for r in rows if r.kind == "torch_ddp")
    # "Best" is the fastest setting, the one a user would pick; its efficiency is what counts.
    gs = [r for r in rows if r.kind == "gradsync" and r.efficiency is not None]
    out: list[tuple[str, bool | None, str]] = [
        (
            "gradsync default step <= 1.0x torch DDP default (round by round)",
            default.paired_to_torch <= 1.0,
            f"{default.paired_to_torch:.3f}x (medians: {default.ratio_to_torch:.3f}x)",
        )
    ]
    if gs and torch_row.efficiency is not None:
        best = min(gs, key=lambda r: r.step)
        assert best.efficiency is not None
        out.append(
            (
                "fastest gradsync bucket setting recovers more of the ideal saving than "
                "torch DDP default",
                best.efficiency > torch_row.efficiency,
                f"{best.name}: {best.efficiency:.2f} vs torch DDP {torch_row.efficiency:.2f}",
            )
        )
    if result.get("rate_mbit"):
        auto = next((r for r in rows if r.kind == "gradsync_auto"), None)
        limit = link_limit(result)
        out += bucket_targets("gradsync default", default, rows, result.get("default_plan"), limit)
        out += bucket_targets("gradsync auto", auto, rows, result.get("auto_plan"), limit)
    at = [b for b in busbw_rows(result) if b.size_bytes == TARGET_BUSBW_BYTES]
    if at and at[0].ratio is not None:
        out.append(
            (
                "all-reduce bus bandwidth >= 0.9x the ring bound at 64 MB",
                at[0].ratio >= 0.9,
                f"{at[0].ratio:.3f}x ({at[0].busbw / 1e6:.1f} MB/s)",
            )
        )
    return out


def fixed_caps(rows: Sequence[VariantRow]) -> list[VariantRow]:
    """The gradsync rows with a numeric (or no) cap: not the default, not "auto"."""
    return [r for r in rows if r.kind == "gradsync" and not isinstance(r.bucket_cap_mb, str)]


def link_limit(result: dict[str, Any]) -> float:
    """The least any step of this setting can take: the limit (module docstring) with every
    gradient byte sent in one all-reduce, the fastest way over the link (``flat_comm``)."""
    compute, fixed = _compute_times(result)
    return step_limit(compute, flat_comm(result)[1], fixed)


def bucket_targets(
    who: str, row: VariantRow | None, rows: Sequence[VariantRow], plan: str | None, limit: float
) -> list[tuple[str, bool, str]]:
    """The issue's bucket targets for ``row`` (gradsync's default or "auto", whose plan was
    ``plan``) against torch DDP and the fastest fixed cap of the same run; none without it.
    ``limit``: :func:`link_limit`, which the first target's numbers state as a ratio too."""
    fixed = fixed_caps(rows)
    if row is None or not fixed:
        return []
    best = min(fixed, key=lambda r: r.step)
    torch_step = row.step / row.ratio_to_torch
    return [
        (
            f"{who} <= 0.85x torch DDP default (round by round)",
            row.paired_to_torch <= 0.85,
            f"{row.paired_to_torch:.3f}x (medians: {row.ratio_to_torch:.3f}x; no step on this "
            f"link under {limit / torch_step:.3f}x)",
        ),
        (
            f"{who} within 3% of the fastest fixed cap",
            row.step <= 1.03 * best.step,
            f"{row.step / best.step:.3f}x {best.name}; {plan or 'its plan not recorded'}",
        ),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def setting_header(result: dict[str, Any]) -> str:
    cfg = result["config"]
    return (
        f"{result['label']}: {result['world']} ranks, {result['backend']}, "
        f"{result['omp_threads']} thread(s) per rank; GPT {result['num_parameters'] / 1e6:.3g}M "
        f"parameters ({cfg['n_layer']} layers x {cfg['n_embd']}), {result['dtype']}, "
        f"{result['grad_bytes'] / 1e6:.3g} MB of gradients, batch {cfg['batch_per_rank']}x"
        f"{cfg['block_size']} tokens per rank; {cfg['rounds']} timed rounds after "
        f"{cfg['warmup']} warm-up" + load_note(result)
    )


def defaults_note(result: dict[str, Any]) -> str:
    """Which wrapper defaults the gradsync rows ran with (all but ``bucket_cap_mb``)."""
    defaults = result.get("gradsync_defaults", {})
    keys = ("first_bucket_cap_mb", "gradient_as_bucket_view", "algorithm", "check_finite")
    shown = ", ".join(f"{k}={defaults[k]}" for k in keys if k in defaults)
    return f"gradsync rows use the wrapper's defaults apart from bucket_cap_mb ({shown})."


def load_note(result: dict[str, Any]) -> str:
    """The run's 1-minute load average before and after, as a clause (empty without it)."""
    if "loadavg_1min" not in result:
        return ""
    before, after = result["loadavg_1min"]
    return f"; 1-min load average {before:.1f} before, {after:.1f} after ({result['cpus']} CPUs)"


def step_table(result: dict[str, Any]) -> str:
    """Markdown table of one setting: medians, ratio to torch DDP, the bounds, efficiency."""
    lines = [
        "| variant | step (ms) | p25-p75 | vs torch DDP | round by round | all-reduces "
        "| comm only (ms) | limit f+max(b,m) | no overlap c+m | overlap eff. |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in variant_rows(result):
        if r.kind == "local" or r.comm == 0:  # compute only, or a wire format (no replay)
            bounds = "| - | - | - | - | - |"
        else:
            eff = "-" if r.efficiency is None else f"{r.efficiency:.2f}"
            bounds = (
                f"| {r.num_calls} | {_ms(r.comm)} | {_ms(r.limit)} | {_ms(r.no_overlap)} | {eff} |"
            )
        lines.append(
            f"| {r.name} | {_ms(r.step)} | {_ms(r.step_p25)}-{_ms(r.step_p75)} "
            f"| {r.ratio_to_torch:.3f} | {r.paired_to_torch:.3f} " + bounds
        )
    name, flat = flat_comm(result)
    lines.append(f"| comm only: {name} | - | - | - | - | 1 | {_ms(flat)} | - | - | - |")
    return "\n".join(lines)


def busbw_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| setting | size | median (ms) | bus bw (MB/s) | link payload rate (MB/s) "
        "| ring bound (ms) | bound / time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for b in busbw_rows(result):
            rate = "-" if b.payload_rate is None else f"{b.payload_rate / 1e6:.1f}"
            bound = "-" if b.ring_bound is None else _ms(b.ring_bound)
            ratio = "-" if b.ratio is None else f"{b.ratio:.3f}"
            lines.append(
                f"| {result['label']} | {b.size_bytes / MIB:g} MiB | {_ms(b.seconds)} "
                f"| {b.busbw / 1e6:.1f} | {rate} | {bound} | {ratio} |"
            )
    return "\n".join(lines)


def target_lines(label: str, verdicts: Sequence[tuple[str, bool | None, str]]) -> list[str]:
    """One line per target of a setting: met, MISSED or n/a, and the numbers."""
    lines = []
    for what, met, numbers in verdicts:
        verdict = "n/a" if met is None else "met" if met else "MISSED"
        lines.append(f"- {label}: {what}: **{verdict}** ({numbers})")
    return lines


def markdown_report(results: Sequence[dict[str, Any]], plots: Sequence[str] = ()) -> str:
    """The whole report: per-setting step tables, bus bandwidth, targets, plot links."""
    parts = ["# gradsync bench", ""]
    for result in results:
        parts += [f"## {result['label']}", "", setting_header(result), ""]
        parts += [defaults_note(result), "", step_table(result), ""]
        parts += wire.report_section(result)
    parts += ["## all-reduce bus bandwidth (float32, one tensor)", "", busbw_table(results), ""]
    parts += ["## targets", ""]
    for result in results:
        parts += target_lines(result["label"], targets(result))
    parts.append("")
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"
