"""The results table of a run: per task, the base, merged and calibrated accuracies and references.

One table feeds the model card's results section, its plot and its ``model-index``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from featcal.metrics import task_score
from featcal.runfolder.reader import RunFolder

FEATCAL_SUFFIX = "_featcal"


@dataclass(frozen=True)
class ResultRow:
    """Accuracies (0..1) for one task, or for the average over tasks; None where not measured."""

    task: str
    base: float | None
    expert: float | None
    merged: float | None
    calibrated: float | None
    reference_merged: float | None
    reference_calibrated: float | None


def _accuracy(metrics: Mapping[str, Any] | None, key: str) -> float | None:
    return task_score((metrics or {}).get(key))


def _mean(values: Sequence[float | None]) -> float | None:
    return fmean(values) if values and all(v is not None for v in values) else None  # type: ignore[arg-type]


def results_rows(run: RunFolder) -> list[ResultRow]:
    """One row per task, in run order, then an ``average`` row (plain mean, as the evaluator does)."""
    merged = run.merged.metrics if run.merged else None
    calibrated = run.calibrated.metrics if run.calibrated else None
    method, _ = run.record.merge.described  # the published references are the merged model's method's
    rows = [
        ResultRow(
            task=task.name,
            base=_accuracy(run.base_metrics, task.name),
            expert=_accuracy(run.expert_metrics, task.name),
            merged=_accuracy(merged, task.name),
            calibrated=_accuracy(calibrated, task.name),
            reference_merged=task.reference_accuracy.get(method) if method else None,
            reference_calibrated=task.reference_accuracy.get(method + FEATCAL_SUFFIX)
            if calibrated and method
            else None,
        )
        for task in run.tasks
    ]

    def average(column: str, metrics: Mapping[str, Any] | None = None) -> float | None:
        reported = _accuracy(metrics, "average") if metrics is not None else None
        return reported if reported is not None else _mean([getattr(r, column) for r in rows])

    rows.append(
        ResultRow(
            task="average",
            base=average("base", run.base_metrics),
            expert=average("expert", run.expert_metrics),
            merged=average("merged", merged),
            calibrated=average("calibrated", calibrated),
            reference_merged=average("reference_merged"),
            reference_calibrated=average("reference_calibrated"),
        )
    )
    return rows
