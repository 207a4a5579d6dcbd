"""The sweep's figure (average and per-task accuracy against n, on a log2 axis, or the swept
parameter; matplotlib, optional extra ``plot``), and the sweep's folder written with it."""

from __future__ import annotations

import logging
from pathlib import Path

from featcal.calibration.params import symbol
from featcal.files.atomic import atomic_folder, atomic_write_json
from featcal.sweep.report import SWEEP_DIR, SWEEP_FILE, SWEEP_PLOT, SweepPoint, SweepReport

logger = logging.getLogger(__name__)

LINE_STYLES = ("-", "--", ":", "-.")


def _series(report: SweepReport) -> tuple[str, list[tuple[str, list[SweepPoint]]]]:
    """The x-axis parameter, and the lines: one per value of the other axis (n along x when n varies)."""
    if len(report.sizes) > 1 or report.parameter is None:
        axis = "num_calibration_examples"
        keys = list(report.values) if report.parameter else [None]
        lines = [
            (
                "" if key is None else f"{symbol(report.parameter)}={key:g}",
                [p for p in report.points if key is None or p.params[report.parameter] == key],
            )
            for key in keys
        ]
    else:
        axis = report.parameter
        lines = [(f"n={report.sizes[0]}", list(report.points))]
    return axis, [(label, sorted(points, key=lambda p: p.params[axis])) for label, points in lines]


def save_sweep_plot(report: SweepReport, path: str | Path) -> bool:
    """Draw the sweep: average accuracy (left) and each task's (right) against the swept values.

    Returns False (after a warning) when matplotlib is not installed; ``sweep.json`` still holds it all.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no sweep.png (install the extra: pip install 'featcal[plot]').")
        return False
    axis, lines = _series(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=100)
    for i, (label, points) in enumerate(lines):
        xs = [p.params[axis] for p in points]
        left.plot(xs, [100 * p.average for p in points], "o" + LINE_STYLES[i % 4], color="#d9793d",
                  label=f"+ FeatCal {label}".strip())  # fmt: skip
        for k, task in enumerate(report.tasks):
            right.plot(xs, [100 * p.tasks[task] for p in points], LINE_STYLES[i % 4], marker=".", color=f"C{k}",
                       label=task if i == 0 else None)  # fmt: skip
    if report.merged is not None:
        left.axhline(100 * report.merged.average, color="#6a8fc7", linestyle="--",
                     label=f"merged ({report.merged_model}, no calibration)")  # fmt: skip
    axis_symbol = symbol(axis)
    for ax, title in ((left, "average over tasks"), (right, "per task")):
        if axis == "num_calibration_examples":
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(report.sizes), [str(n) for n in report.sizes])
            ax.minorticks_off()
            ax.set_xlabel("n: calibration images per task (log2)")
        else:
            ax.set_xlabel(f"{axis_symbol} ({axis})")
        ax.set_ylabel("zero-shot accuracy (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return True


def write_sweep(run: Path, report: SweepReport) -> Path:
    """Write ``<run>/sweep/`` (``sweep.json`` and, with matplotlib, ``sweep.png``) in a temporary
    folder renamed into place, replacing an earlier sweep; returns the folder."""
    final = Path(run) / SWEEP_DIR
    with atomic_folder(final) as tmp:
        atomic_write_json(tmp / SWEEP_FILE, report.to_json())
        save_sweep_plot(report, tmp / SWEEP_PLOT)
    return final
