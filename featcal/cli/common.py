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
    NLL, lower is better), its exact match in % where the task has one, the average loss, and the average exact
    match where every task has one (:func:`mean_exact_match`); one column
    per stage, and, with the experts, a merged stage and its calibration, the share of the expert − merged
    gap the calibration closed (``closed``, in %).

    Args:
        results: Evaluation reports by stage name, in column order.
        labels: Column headings by stage name (default: the stage names).
        column: The width of a column.
    """
    from featcal.metrics import AVERAGE, EXACT_MATCH, gap_closed
    from featcal.runfolder.layout import CALIBRATED_PREFIX, EXPERTS_DIR

    stages = list(results)
    merged = next((s for s in stages if CALIBRATED_PREFIX + s in results), None)
    closing = (EXPERTS_DIR, merged, CALIBRATED_PREFIX + str(merged)) if merged and EXPERTS_DIR in results else None
    blank = f"{'-':>{column}}"

    def cells(values: dict[str, float | None], scale: float, digits: int) -> list[str]:
        out = [blank if values[s] is None else f"{scale * values[s]:>{column}.{digits}f}" for s in stages]
        if closing is not None:
            expert, before, after = (values[s] for s in closing)
            share = None if None in (expert, before, after) else gap_closed(expert, before, after)
            out.append(blank if share is None else f"{100 * share:>{column}.1f}")
        return out

    tasks = list(dict.fromkeys(name for report in results.values() for name in report.tasks))
    rows: list[tuple[str, list[str]]] = []
    for name in tasks:
        found = {s: results[s].tasks.get(name) for s in stages}
        rows.append((f"{name} loss", cells({s: r.loss if r else None for s, r in found.items()}, 1, 4)))
        matches = {s: r.extra.get(EXACT_MATCH) if r else None for s, r in found.items()}
        if any(value is not None for value in matches.values()):
            rows.append((f"{name} exact match %", cells(matches, 100, 2)))
    averages = {s: results[s].loss(AVERAGE) if results[s].average else None for s in stages}
    rows.append(("average loss", cells(averages, 1, 4)))
    mean_matches = {s: mean_exact_match(results[s]) for s in stages}
    if any(value is not None for value in mean_matches.values()):
        rows.append(("average exact match %", cells(mean_matches, 100, 2)))
    width = max(len(label) for label, _ in rows)
    headings = [*((labels or {}).get(s, s) for s in stages), *(["closed %"] if closing else [])]
    heading = f"{'task':<{width}}  " + "  ".join(f"{h:>{column}}" for h in headings)
    return "\n".join([heading, *(f"{label:<{width}}  " + "  ".join(row) for label, row in rows)])


def mean_exact_match(report: MetricsReport) -> float | None:
    """The plain mean of a language model's exact match over its tasks, or None unless every task has one
    (the table's average row; ``metrics.json`` keeps the tasks' own values only).

    Args:
        report: A language model's evaluation report.

    Returns:
        The mean, in [0, 1], or None.
    """
    from featcal.metrics import EXACT_MATCH

    matches = [result.extra.get(EXACT_MATCH) for result in report.tasks.values()]
    if not matches or any(value is None for value in matches):
        return None
    return sum(matches) / len(matches)


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars unless ``-q`` was given or FEATCAL_NO_PROGRESS is set."""
    return not getattr(args, "quiet", False) and progress.is_enabled()


def path_line(label: str, path: str | os.PathLike[str]) -> str:
    """``Label: /absolute/path``, resolved: the one way the CLI prints a file or folder."""
    return f"{label}: {Path(path).resolve()}"
