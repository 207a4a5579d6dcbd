"""The plot of ``diagnostics.json``: drift per layer and task, before and after FeatCal (matplotlib, extra ``plot``)."""

from __future__ import annotations

import logging
from pathlib import Path

from featcal.diagnostics.report import DriftReport

logger = logging.getLogger(__name__)


def save_drift_plot(report: DriftReport, path: str | Path) -> bool:
    """Draw one heat map (rows: measuring points, columns: tasks) per measured model on one colour
    scale, and the mean over tasks per point as lines.

    Returns False (after a warning) when matplotlib is not installed; there is then no plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning(
            "matplotlib is not installed: the diagnostics get no plot (install the extra: pip install 'featcal[plot]')."
        )
        return False

    d = report.drift
    models, tasks, points = d.models, d.tasks, d.points
    tables = {m: [[d.drift[m][t][p] for t in tasks] for p in range(len(points))] for m in models}
    top = max(v for table in tables.values() for row in table for v in row) or 1.0
    width = max(3.0, 0.55 * len(tasks) + 1.5)
    fig, axes = plt.subplots(
        1,
        len(models) + 1,
        figsize=(width * len(models) + 5.0, max(3.0, 0.4 * len(points) + 2.0)),
        dpi=100,
        layout="constrained",
        gridspec_kw={"width_ratios": [width] * len(models) + [4.0]},
    )
    image = None
    for i, (ax, model) in enumerate(zip(axes, models)):
        image = ax.imshow(tables[model], cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
        ax.set_title(report.labels[model], fontsize=9)
        ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(points)), points if i == 0 else [], fontsize=8)
        if len(tasks) * len(points) <= 120:
            for p, row in enumerate(tables[model]):
                for t, value in enumerate(row):
                    color = "black" if value > 0.6 * top else "white"
                    ax.text(t, p, f"{value:.2f}", ha="center", va="center", fontsize=6, color=color)
    fig.colorbar(image, ax=list(axes[:-1]), shrink=0.9, label="relative drift", pad=0.02)
    lines = axes[-1]
    for model, color in zip(models, ("#6a8fc7", "#d9793d")):
        means = [sum(row) / len(row) for row in tables[model]]
        lines.plot(range(len(points)), means, marker="o", color=color, label=report.labels[model])
    lines.set_xticks(range(len(points)), points, rotation=45, ha="right", fontsize=8)
    lines.set_title("mean over tasks", fontsize=9)
    lines.set_ylim(bottom=0)
    lines.grid(alpha=0.3)
    lines.legend(fontsize=7, frameon=False)
    fig.suptitle(f"Relative feature drift from each task's expert ({report.split} {report.noun}s)", fontsize=10)
    fig.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return True
