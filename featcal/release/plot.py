"""The results plot of the model card: grouped bars per task (matplotlib, optional extra ``plot``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from featcal.release.results import ResultRow

logger = logging.getLogger(__name__)

PLOT_FILE = "results.png"


def save_results_plot(rows: Sequence[ResultRow], path: str | Path, *, merged_label: str) -> bool:
    """Draw base / expert / merged / + FeatCal accuracies per task, with published references as markers.

    Returns False (after a warning) when matplotlib is not installed; the card then has no image.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning(
            "matplotlib is not installed: the model card gets no results plot "
            "(install the extra: pip install 'featcal[plot]')."
        )
        return False

    series = [
        ("base", "Zero-shot base", "#b0b0b0"),
        ("expert", "Task expert (alone)", "#8fbf8f"),
        ("merged", merged_label, "#6a8fc7"),
        ("calibrated", f"{merged_label} + FeatCal", "#d9793d"),
    ]
    series = [s for s in series if any(getattr(r, s[0]) is not None for r in rows)]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.0), dpi=100)
    reference_label = "published reference"
    for i, (column, label, color) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(rows))]
        ax.bar(xs, [100 * (getattr(r, column) or 0.0) for r in rows], width, label=label, color=color)
        if column not in ("merged", "calibrated"):
            continue
        reference = f"reference_{column}"
        points = [(x, 100 * getattr(r, reference)) for x, r in zip(xs, rows) if getattr(r, reference) is not None]
        if points:
            ax.scatter(*zip(*points), marker="_", s=240, linewidths=2, color="black", zorder=3, label=reference_label)
            reference_label = None  # one legend entry for all reference markers
    ax.set_xticks(range(len(rows)), [r.task for r in rows], rotation=30, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return True
