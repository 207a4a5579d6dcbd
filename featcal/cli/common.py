"""Printing helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from featcal import progress

if TYPE_CHECKING:
    from featcal.metrics import MetricsReport


def format_results(
    results: Mapping[str, MetricsReport], labels: Mapping[str, str] | None = None, *, column: int = 14
) -> str:
    """A plain-text table: one row per task and the average, one column per stage, accuracies in %.

    Args:
        results: Evaluation reports by stage name, in column order.
        labels: Column headings by stage name (default: the stage names).
        column: The width of a column.
    """
    stages = list(results)
    tasks = list(dict.fromkeys(name for report in results.values() for name in report.tasks))
    width = max([len(t) for t in tasks] + [7])
    lines = [f"{'task':<{width}}  " + "  ".join(f"{(labels or {}).get(s, s):>{column}}" for s in stages)]
    for name in [*tasks, "average"]:
        cells = []
        for stage in stages:
            report = results[stage]
            known = name in report.tasks or (name == "average" and report.average is not None)
            cells.append(f"{100 * report.accuracy(name):>{column}.2f}" if known else f"{'-':>{column}}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars unless ``-q`` was given or FEATCAL_NO_PROGRESS is set."""
    return not getattr(args, "quiet", False) and progress.is_enabled()


def path_line(label: str, path: str | os.PathLike[str]) -> str:
    """``Label: /absolute/path``, resolved: the one way the CLI prints a file or folder."""
    return f"{label}: {Path(path).resolve()}"
