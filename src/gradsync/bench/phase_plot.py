"""A picture of where each rank's steps went: the step timeline's phases, rank by rank.

One row per rank (the first ``max_ranks``), one stacked bar per step: data loading, forward,
backward, optimizer step, and the communication left exposed at the end of backward. A
straggler stands out as the rank whose bar has the least exposed communication (everyone
else waited for it) and a taller segment in the phase that made it late.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gradsync.timing import PHASES, RankStep

COLOURS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#c44e52",
    "exposed_comm": "#dd8452",
}


def plot_step_phases(
    history: Sequence[tuple[int, Sequence[RankStep | None]]],
    path: str,
    max_ranks: int = 8,
    title: str = "",
) -> None:
    """Write the plot of ``history`` (``model.timeline.history``: ``(step, records)`` pairs)
    to ``path`` (PNG, SVG or PDF, by its suffix). Needs matplotlib (``gradsync[bench]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = max((len(records) for _, records in history), default=0)
    ranks = list(range(min(world, max_ranks)))
    fig, axes = plt.subplots(
        len(ranks) or 1, 1, figsize=(9, 1.3 + 1.1 * len(ranks)), sharex=True, squeeze=False
    )
    for row, rank in zip(axes[:, 0], ranks, strict=False):
        steps = [s for s, records in history if records[rank] is not None]
        bottoms = [0.0] * len(steps)
        for phase in PHASES:
            heights = [
                records[rank][phase]  # type: ignore[index]
                for _, records in history
                if records[rank] is not None
            ]
            row.bar(steps, heights, bottom=bottoms, color=COLOURS[phase], width=0.85, label=phase)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        row.set_ylabel(f"rank {rank}\nms", fontsize=8)
        row.tick_params(labelsize=8)
    axes[0, 0].legend(ncols=len(PHASES), fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0))
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # --out may point elsewhere
    fig.savefig(path, dpi=110)
    plt.close(fig)
