"""The two plots of ``gradsync bench``: step time per bucket cap, and where each step goes.

The step-vs-cap plot draws each fixed cap inside its band from the limit (``max(compute,
comm)``) to no overlap (``compute + comm``), with torch DDP, gradsync's default, "auto",
``average_gradients`` and compute alone as lines; see ``report.py`` for what the band means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradsync.bench.report import fixed_caps, variant_rows
from gradsync.bench.variant import DEFAULT_CAP
from gradsync.ddp.plan import SCALED


def _cap_label(cap: float | str | None) -> str:
    one = cap is None or cap == float("inf")
    return "one" if one else str(cap) if isinstance(cap, str) else f"{cap:g}"


def plot_step_vs_bucket(results: Sequence[dict[str, Any]], path: str) -> None:
    """Step time of gradsync per bucket cap, inside the band [limit, no overlap] of that cap,
    with torch DDP, ``average_gradients`` and compute alone as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        rows = variant_rows(result)
        gs = fixed_caps(rows)
        gs.sort(key=lambda r: float("inf") if r.bucket_cap_mb is None else r.bucket_cap_mb)
        xs = list(range(len(gs)))
        ms = [r.step * 1e3 for r in gs]
        err = [[(r.step - r.step_p25) * 1e3 for r in gs], [(r.step_p75 - r.step) * 1e3 for r in gs]]
        ax.fill_between(
            xs,
            [r.limit * 1e3 for r in gs],
            [r.no_overlap * 1e3 for r in gs],
            color="tab:blue",
            alpha=0.12,
            label="limit .. no overlap",
        )
        ax.errorbar(xs, ms, yerr=err, marker="o", color="tab:blue", capsize=3, label="gradsync")
        styles = {
            "torch_ddp": ("tab:red", "--"),
            "naive": ("tab:gray", ":"),
            "gradsync_auto": ("tab:green", "-."),
            SCALED: ("tab:purple", "-."),
            DEFAULT_CAP: ("tab:orange", "-"),
        }
        for r in rows:
            words = (SCALED, DEFAULT_CAP)
            style = styles.get(r.bucket_cap_mb if r.bucket_cap_mb in words else r.kind)
            if style is not None:
                color, ls = style
                ax.axhline(r.step * 1e3, color=color, ls=ls, label=r.name)
            elif r.kind == "local":
                ax.axhline(r.step * 1e3, color="black", lw=0.8, label="compute only")
        ax.set_xticks(xs, [_cap_label(r.bucket_cap_mb) for r in gs])
        ax.set_xlabel("gradsync bucket_cap_mb (MiB)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(result["label"], fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_breakdown(results: Sequence[dict[str, Any]], path: str) -> None:
    """Bars per variant: compute alone, communication alone, and the measured step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        rows = [r for r in variant_rows(result) if r.kind != "local"]
        xs = range(len(rows))
        w = 0.27
        ax.bar([x - w for x in xs], [r.compute * 1e3 for r in rows], w, label="compute only")
        ax.bar(list(xs), [r.comm * 1e3 for r in rows], w, label="comm only")
        ax.bar([x + w for x in xs], [r.step * 1e3 for r in rows], w, label="step")
        # Where the step could be (limit) and would be without overlap, over the step bar.
        sx = [x + w for x in xs]
        limit, serial = [r.limit * 1e3 for r in rows], [r.no_overlap * 1e3 for r in rows]
        ax.scatter(sx, limit, marker="_", s=250, c="k", label="limit")
        ax.scatter(sx, serial, marker="_", s=250, c="tab:red", label="no overlap")
        labels = [r.name.replace("gradsync ", "gs ").replace(" (scaled)", "*") for r in rows]
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("median (ms)")
        ax.set_title(result["label"], fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        top = max(max(r.step, r.no_overlap, r.compute, r.comm) for r in rows)
        ax.set_ylim(0, 1.2 * top * 1e3)  # headroom for the legend
    axes[0][0].legend(fontsize=7, ncols=5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
