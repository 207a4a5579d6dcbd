"""The results of a language-model run as its card shows them: per task the held-out loss (and exact match)
of the base, the task's expert, the merged and the calibrated models, the share of the expert − merged gap
that calibration closed, the lm-evaluation-harness results, and the reference numbers quoted for the suite.

Everything comes from the run folder's reports (``metrics.json`` of each stage) and record; this module
imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from featcal.metrics import AVERAGE, EXACT_MATCH, LM_EVAL, gap_closed
from featcal.runfolder.reader import RunFolder

STAGES = ("base", "expert", "merged", "calibrated")


@dataclass(frozen=True)
class Measure:
    """One measure of one task (or the average) for each stage; None where not measured.

    Attributes:
        values: By stage (:data:`STAGES`).
        closed: The share of the expert − merged gap the calibration closed (None without the three).
    """

    values: Mapping[str, float | None]

    @property
    def closed(self) -> float | None:
        """The share of the expert − merged gap closed (:func:`featcal.metrics.gap_closed`); None without the three."""
        expert, merged, calibrated = (self.values.get(k) for k in ("expert", "merged", "calibrated"))
        if expert is None or merged is None or calibrated is None:
            return None
        return gap_closed(expert, merged, calibrated)


@dataclass(frozen=True)
class TaskResult:
    """A task's held-out results: loss, exact match (None for a task without one answer), where its rows lie."""

    task: str
    loss: Measure
    exact_match: Measure | None
    held_out: Mapping[str, Any]


def _reports(run: RunFolder) -> dict[str, Mapping[str, Any] | None]:
    return {
        "base": run.base_metrics,
        "expert": run.expert_metrics,
        "merged": run.merged.metrics if run.merged else None,
        "calibrated": run.calibrated.metrics if run.calibrated else None,
    }


def _value(report: Mapping[str, Any] | None, task: str, key: str) -> float | None:
    entry = (report or {}).get(task)
    value = entry.get(key) if isinstance(entry, Mapping) else None
    return None if value is None else float(value)


def task_results(run: RunFolder) -> list[TaskResult]:
    """One result per task of the run, in order, then the ``average`` (its loss: the tasks' mean)."""
    reports = _reports(run)
    out = []
    for task in run.tasks:
        loss = Measure({stage: _value(report, task.name, "loss") for stage, report in reports.items()})
        matches = {stage: _value(report, task.name, EXACT_MATCH) for stage, report in reports.items()}
        has_match = task.text is not None and task.text.answer is not None
        entry = (run.released.metrics or {}).get(task.name) or {}
        out.append(TaskResult(task.name, loss, Measure(matches) if has_match else None, entry.get("held_out") or {}))
    averages = {}
    for stage, report in reports.items():
        reported = _value(report, AVERAGE, "loss")
        losses = [r.loss.values[stage] for r in out]
        averages[stage] = reported if reported is not None else (fmean(losses) if None not in losses else None)
    out.append(TaskResult(AVERAGE, Measure(averages), None, {}))
    return out


def harness_results(run: RunFolder) -> list[dict[str, Any]]:
    """lm-evaluation-harness's results, one row per harness task and metric: the base's, the merged and
    calibrated models' and, for a harness task of a task's benchmark, that task's expert's."""
    reports = _reports(run)
    stages = {stage: (report or {}).get(LM_EVAL) or {} for stage, report in reports.items() if stage != "expert"}
    expert = {}
    for entry in (reports["expert"] or {}).values():
        if isinstance(entry, Mapping):
            expert.update(entry.get(LM_EVAL) or {})
    stages["expert"] = expert
    names = list(dict.fromkeys(name for results in stages.values() for name in results))
    rows = []
    for name in names:
        metrics = list(dict.fromkeys(m for results in stages.values() for m in (results.get(name) or {})))
        for metric in metrics:
            values = {stage: (stages[stage].get(name) or {}).get(metric) for stage in STAGES}
            rows.append({"task": name, "metric": metric, "measure": Measure(values)})
    return rows
