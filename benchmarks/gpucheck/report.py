"""The GPU check's report: ``<name>.json`` (every check, every figure) and ``<name>.md``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .common import FAILING, MISSED, Check

TITLES = {
    "correctness": "Correctness: N processes train what one process trains",
    "syncs": "Host syncs per step",
    "overlap": "Overlap of communication with backward",
    "speed": "Step time",
    "deadline": "The NCCL deadline",
}


def summary(checks: list[Check]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in checks:
        counts[c.status] = counts.get(c.status, 0) + 1
    return counts


def exit_status(checks: list[Check]) -> int:
    """1 if any check failed or could not run through an error (a speed target is never
    ``fail``: a miss is ``missed``, reported only)."""
    return int(any(c.status in FAILING for c in checks))


def write(out: Path, name: str, env: dict[str, Any], meta: dict[str, Any],
          checks: list[Check]) -> tuple[Path, Path]:  # fmt: skip
    """Write both files; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": env, "run": meta, "summary": summary(checks),
           "checks": [_jsonable(vars(c)) for c in checks]}  # fmt: skip
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    md.write_text(markdown(env, meta, checks))
    return md, js


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.4g}"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) if value else "none"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown(env: dict[str, Any], meta: dict[str, Any], checks: list[Check]) -> str:
    gpus = ", ".join(env.get("gpus", [])) or "no GPU"
    what = (
        "Dry run on CPU (gloo ranks, tiny models): it shows that the script is wired, not that "
        "the claims hold on a GPU."
        if meta["dry"]
        else "On the GPU, one command (`make gpu-check`)."
    )
    lines = [
        f"# GPU check: {meta['device']}, {env['date']}",
        "",
        what,
        "",
        f"- device: {gpus}" + (f" ({env['gpu_memory_gib']} GiB)" if "gpu_memory_gib" in env
                               else ""),
        f"- torch {env['torch']}, CUDA {env['cuda']}, NCCL {env.get('nccl', '-')}, "
        f"{env['cpus']} CPUs",
        f"- command: `{meta['command']}`; {meta['seconds']:.0f} s of a {meta['budget_s']:.0f} s "
        "budget",
        f"- result: {_fmt(summary(checks))}; exit status {exit_status(checks)} "
        "(non-zero when a check fails or errs; a missed speed target does not count)",
        "",
    ]  # fmt: skip
    group_time = meta.get("group_seconds", {})
    for group, title in TITLES.items():
        mine = [c for c in checks if c.id.split(".")[0] == group]
        if not mine:
            continue
        took = group_time.get(group)
        lines += [f"## {title}" + (f" ({took:.0f} s)" if took is not None else ""), ""]
        lines += ["| check | status | compares | bound or target |", "|---|---|---|---|"]
        for c in mine:
            status = c.status.upper() if c.status in FAILING or c.status == MISSED else c.status
            lines.append(f"| `{c.id}` | {status} | {_fmt(c.compares)} | {_fmt(c.bound)} |")
        lines.append("")
        for c in mine:
            lines.append(f"**`{c.id}`** ({c.status})" + (f": {c.reason}" if c.reason else ""))
            lines.append("")
            for key, value in c.measured.items():
                lines.append(f"- {key}: {_fmt(value)}")
            if c.measured:
                lines.append("")
    return "\n".join(lines) + "\n"
