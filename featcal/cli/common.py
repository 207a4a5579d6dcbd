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

    Reports without accuracies (a language model's) are shown by :func:`format_losses` instead.

    Args:
        results: Evaluation reports by stage name, in column order.
        labels: Column headings by stage name (default: the stage names).
        column: The width of a column.
    """
    if not all(report.has_accuracy for report in results.values()):
        return format_losses(results, labels, column=column)
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


def format_losses(
    results: Mapping[str, MetricsReport], labels: Mapping[str, str] | None = None, *, column: int = 14
) -> str:
    """A plain-text table of a language model's reports: per task its held-out loss (mean response-token
    NLL, lower is better), its exact match in % where the task has one, and the average loss; one column
    per stage.

    Args:
        results: Evaluation reports by stage name, in column order.
        labels: Column headings by stage name (default: the stage names).
        column: The width of a column.
    """
    from featcal.metrics import AVERAGE, EXACT_MATCH

    stages = list(results)
    tasks = list(dict.fromkeys(name for report in results.values() for name in report.tasks))
    rows: list[tuple[str, list[str]]] = []
    for name in tasks:
        losses, matches = [], []
        for stage in stages:
            result = results[stage].tasks.get(name)
            losses.append(f"{result.loss:>{column}.4f}" if result is not None else f"{'-':>{column}}")
            match = None if result is None else result.extra.get(EXACT_MATCH)
            matches.append(f"{100 * match:>{column}.2f}" if match is not None else f"{'-':>{column}}")
        rows.append((f"{name} loss", losses))
        if any(cell.strip() != "-" for cell in matches):
            rows.append((f"{name} exact match %", matches))
    averages = [
        f"{results[s].loss(AVERAGE):>{column}.4f}" if results[s].average else f"{'-':>{column}}" for s in stages
    ]
    rows.append(("average loss", averages))
    width = max(len(label) for label, _ in rows)
    heading = f"{'task':<{width}}  " + "  ".join(f"{(labels or {}).get(s, s):>{column}}" for s in stages)
    return "\n".join([heading, *(f"{label:<{width}}  " + "  ".join(cells) for label, cells in rows)])


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars unless ``-q`` was given or FEATCAL_NO_PROGRESS is set."""
    return not getattr(args, "quiet", False) and progress.is_enabled()


def path_line(label: str, path: str | os.PathLike[str]) -> str:
    """``Label: /absolute/path``, resolved: the one way the CLI prints a file or folder."""
    return f"{label}: {Path(path).resolve()}"
