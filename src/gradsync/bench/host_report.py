"""The report of ``gradsync bench --where host`` (:mod:`gradsync.bench.hostbound`).

Per world size: each variant's median step and quartiles, its ratio to torch DDP (of the
medians, and round by round: :func:`gradsync.bench.report.paired_ratio`), and what it costs
over the module alone (its step less the ``local`` variant's: the host work of synchronising,
the all-reduce included). Two targets, both read round by round: gradsync's default step at
most 1.00x torch DDP's, and the step timeline at most 1.01x of gradsync's step (gradsync's
default, timeline on, over the same wrapper with ``straggler_every=0``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync.bench.report import load_note, paired_ratio, percentile, target_lines

TARGET_VS_TORCH = 1.00
TARGET_TIMELINE = 1.01


@dataclass(frozen=True)
class HostRow:
    """One variant at one world size, times in seconds per step (over the rounds)."""

    name: str
    step: float
    step_p25: float
    step_p75: float
    ratio_to_torch: float
    """The step's median over torch DDP's median."""
    paired_to_torch: float
    """The median over rounds of the step over torch DDP's step in the same round."""
    over_local: float
    """The step's median less the module-alone step's median."""
    all_reduces: int | None


def _names(result: dict[str, Any]) -> dict[str, str]:
    """The variant names by role: torch, default, timeline_off, local."""
    roles = {}
    for v in result["variants"]:
        if v["kind"] == "torch_ddp":
            roles["torch"] = v["name"]
        elif v["kind"] == "local":
            roles["local"] = v["name"]
        elif v["kind"] == "gradsync":
            off = v.get("straggler_every") == 0
            roles["timeline_off" if off else "default"] = v["name"]
    return roles


def host_rows(result: dict[str, Any]) -> list[HostRow]:
    """Every variant's row, in the order the run listed them."""
    step_s, names = result["step_s"], _names(result)
    torch_times = step_s[names["torch"]]
    torch_step = statistics.median(torch_times)
    local = statistics.median(step_s[names["local"]])
    rows = []
    for v in result["variants"]:
        times = step_s[v["name"]]
        step = statistics.median(times)
        rows.append(
            HostRow(
                name=v["name"],
                step=step,
                step_p25=percentile(times, 25),
                step_p75=percentile(times, 75),
                ratio_to_torch=step / torch_step,
                paired_to_torch=paired_ratio(times, torch_times),
                over_local=step - local,
                all_reduces=result.get("all_reduces", {}).get(v["name"]),
            )
        )
    return rows


def ratio_spread(times: list[float], base: list[float]) -> str:
    """The quartiles of the per-round ratios, ``"p25-p75"``: how far apart the rounds were,
    which says whether a ratio's distance from its target is more than noise."""
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    return f"{percentile(ratios, 25):.3f}-{percentile(ratios, 75):.3f}"


def timeline_cost(result: dict[str, Any]) -> tuple[float, float]:
    """gradsync's default step over its step with the timeline off: (round by round, of the
    medians)."""
    names = _names(result)
    on, off = result["step_s"][names["default"]], result["step_s"][names["timeline_off"]]
    return paired_ratio(on, off), statistics.median(on) / statistics.median(off)


def sync_cost_ratio(result: dict[str, Any]) -> float | None:
    """gradsync's cost over the module alone over torch DDP's (medians); ``None`` where torch
    DDP's step was not slower than the module's alone (nothing to compare with)."""
    rows = {r.name: r for r in host_rows(result)}
    names = _names(result)
    torch_cost = rows[names["torch"]].over_local
    return rows[names["default"]].over_local / torch_cost if torch_cost > 0 else None


def host_targets(result: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met?, the numbers) at one world size."""
    names, step_s = _names(result), result["step_s"]
    default = next(r for r in host_rows(result) if r.name == names["default"])
    on, off, base = step_s[names["default"]], step_s[names["timeline_off"]], step_s[names["torch"]]
    paired, medians = timeline_cost(result)
    return [
        (
            f"gradsync default step <= {TARGET_VS_TORCH:.2f}x torch DDP default (round by round)",
            default.paired_to_torch <= TARGET_VS_TORCH,
            f"{default.paired_to_torch:.3f}x, rounds {ratio_spread(on, base)}; medians: "
            f"{default.ratio_to_torch:.3f}x",
        ),
        (
            f"the step timeline <= {TARGET_TIMELINE:.2f}x of gradsync's step (default over "
            "straggler_every=0, round by round)",
            paired <= TARGET_TIMELINE,
            f"{paired:.3f}x, rounds {ratio_spread(on, off)}; medians: {medians:.3f}x",
        ),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def summary_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per world size: every variant's median step and the three ratios."""
    lines = [
        "| ranks | torch DDP (ms) | gradsync default (ms) | gradsync timeline off (ms) "
        "| module alone (ms) | gradsync / torch DDP | timeline on / off | gradsync's cost over "
        "the module / torch DDP's |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        names = _names(result)
        rows = {r.name: r for r in host_rows(result)}
        paired, _ = timeline_cost(result)
        cost = sync_cost_ratio(result)
        steps = " | ".join(
            _ms(rows[names[role]].step) for role in ("torch", "default", "timeline_off", "local")
        )
        lines.append(
            f"| {result['world']} | {steps} | {rows[names['default']].paired_to_torch:.3f} "
            f"| {paired:.3f} | {'-' if cost is None else f'{cost:.2f}'} |"
        )
    return "\n".join(lines)


def step_table(result: dict[str, Any]) -> str:
    """Markdown table of one world size: medians, quartiles, ratios to torch DDP, cost."""
    lines = [
        "| variant | step (ms) | p25-p75 | vs torch DDP | round by round | over the module "
        "alone (ms) | all-reduces a step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in host_rows(result):
        calls = "-" if r.all_reduces is None else str(r.all_reduces)
        lines.append(
            f"| {r.name} | {_ms(r.step)} | {_ms(r.step_p25)}-{_ms(r.step_p75)} "
            f"| {r.ratio_to_torch:.3f} | {r.paired_to_torch:.3f} | {_ms(r.over_local)} "
            f"| {calls} |"
        )
    return "\n".join(lines)


def setting_header(result: dict[str, Any]) -> str:
    cfg = result["config"]
    width = cfg["width"]
    return (
        f"{result['label']}: {result['backend']}, "
        f"{result['omp_threads']} thread(s) per rank, torch {result['torch']}; "
        f"{cfg['num_layers']} x Linear({width}, {width}): {result['num_tensors']} parameter "
        f"tensors, {result['num_parameters']} parameters; batch {cfg['batch_per_rank']} x "
        f"{width} per rank, SGD; {cfg['rounds']} timed rounds of {cfg['steps_per_round']} "
        f"steps per variant after {cfg['warmup']} warm-up" + load_note(result)
    )


def markdown_report(results: Sequence[dict[str, Any]]) -> str:
    """The whole report: the summary over world sizes, each one's table, the targets."""
    parts = ["# gradsync bench: host-bound step", "", summary_table(results), ""]
    parts += [
        "Times per step. Ratios to torch DDP and the timeline's cost are round by round; the "
        "last column is (gradsync's step - the module's) / (torch DDP's step - the module's), "
        "of the medians: what synchronising costs in each library.",
        "",
    ]
    for result in results:
        parts += [f"## {result['label']}", "", setting_header(result), ""]
        parts += [step_table(result), ""]
    parts += ["## targets", ""]
    for result in results:
        parts += target_lines(result["label"], host_targets(result))
    return "\n".join(parts) + "\n"
