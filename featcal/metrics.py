"""The typed metrics report: per-task results, their average, the model's size, and the run it belongs to.

Every family's evaluator returns a :class:`MetricsReport`; on disk (``metrics.json``) it has the
FeatCal reference run's flat layout. A task's result is its accuracy and loss (CLIP), or, for a task
that has no accuracy (a language task whose responses have no single answer), its loss alone; a family
adds its own measures beside them (a language task's exact match). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import RunFolderError

if TYPE_CHECKING:
    from torch import nn

# Keys of a metrics report beside the tasks; task tables refuse tasks with these names.
AVERAGE, MODEL_INFO, RUN_ID = "average", "model_info", "run_id"
CALIBRATION_EXAMPLES_USED = "calibration_examples_used"
# The SHA-256 of each weight file of the model a report measured, by its path in the model's folder: a
# report is the record of those weights, and of no others.
WEIGHTS_SHA256 = "weights_sha256"
# lm-evaluation-harness's results of a language model, beside its tasks (:mod:`featcal.families.causal_lm.harness`).
LM_EVAL = "lm_eval"
RESERVED_TASK_NAMES = frozenset({AVERAGE, MODEL_INFO, RUN_ID, CALIBRATION_EXAMPLES_USED, WEIGHTS_SHA256, LM_EVAL})
# A language task's further measure where its responses have one answer: the share of greedy answers equal
# to the reference's (:mod:`featcal.families.causal_lm.evaluation`).
EXACT_MATCH = "exact_match"
# The keys that make an entry of metrics.json a task's result (its accuracy, or its loss alone).
RESULT_KEYS = ("accuracy", "loss")
# A task whose result names its metric (``"metric"``: a T5 task's exact match or Spearman's ρ) stores its score
# under that metric's name instead of ``accuracy``; files written before that kept it under ``accuracy``, and
# read alike (:func:`task_score`).
METRIC = "metric"
SCORE_METRICS = ("exact_match", "spearman")


def count_parameters(model: nn.Module) -> dict[str, float | int]:
    """Parameter counts in the reference run's ``model_info`` format."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "trainable_params": trainable,
        "all_params": total,
        "trainable_percentage": trainable / total if total else 0.0,
    }


@dataclass(frozen=True)
class TaskMetrics:
    """One task's result: accuracy (0..1; None for a task that has none), mean cross-entropy, the examples
    counted, and the family's further measures (``extra``: a language task's exact match, its tokens)."""

    accuracy: float | None
    loss: float
    num_samples: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The task's entry of ``metrics.json``: its score under ``accuracy``, or under its metric's name."""
        data: dict[str, Any] = {} if self.accuracy is None else {score_key(self.extra): self.accuracy}
        data["loss"] = self.loss
        if self.num_samples is not None:
            data["num_samples"] = self.num_samples
        data.update(self.extra)
        return data


def score_key(entry: Mapping[str, Any]) -> str:
    """Where a task's result stores its score: under its metric's name when it names one of
    :data:`SCORE_METRICS`, else under ``accuracy``."""
    metric = entry.get(METRIC)
    return metric if metric in SCORE_METRICS else "accuracy"


def task_score(entry: Any) -> float | None:
    """A task's score from its ``metrics.json`` entry (or the average's accuracy): the value under
    :func:`score_key`, else under ``accuracy`` (files written before T5 scores had their metric's name);
    None when it has neither."""
    if not isinstance(entry, Mapping):
        return None
    for key in dict.fromkeys((score_key(entry), "accuracy")):
        if entry.get(key) is not None:
            return float(entry[key])
    return None


def is_task_result(value: Any) -> bool:
    """Whether an entry of ``metrics.json`` is a task's result (a mapping with an accuracy or a loss)."""
    return isinstance(value, Mapping) and any(key in value for key in RESULT_KEYS)


@dataclass(frozen=True)
class MetricsReport:
    """An evaluation report: per-task results kept apart from the average, model info and run id.

    On disk (``metrics.json``) it has the reference run's flat layout: ``model_info``, one entry per
    task, ``average``, ``run_id``.
    """

    tasks: Mapping[str, TaskMetrics]
    average: Mapping[str, float] | None = None
    model_info: Mapping[str, Any] | None = None
    run_id: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_results(
        cls, results: Mapping[str, TaskMetrics], *, model_info: Mapping[str, Any] | None = None
    ) -> MetricsReport:
        """A report whose average is the plain mean of the tasks' accuracies (when every task has one) and
        losses."""
        count = len(results)
        accuracies = [r.accuracy for r in results.values()]
        average = {} if None in accuracies else {"accuracy": sum(accuracies) / count}  # type: ignore[arg-type]
        average["loss"] = sum(r.loss for r in results.values()) / count
        return cls(tasks=dict(results), average=average, model_info=model_info)

    @property
    def has_accuracy(self) -> bool:
        """Whether every task of the report has an accuracy (a CLIP report; a language model's has losses)."""
        return all(result.accuracy is not None for result in self.tasks.values())

    def accuracy(self, task: str) -> float:
        """The accuracy of ``task``, or the average's for :data:`AVERAGE`.

        Raises:
            KeyError: for a task (or an average) without an accuracy.
        """
        if task == AVERAGE:
            if self.average is None or "accuracy" not in self.average:
                raise KeyError(AVERAGE)
            return float(self.average["accuracy"])
        value = self.tasks[task].accuracy
        if value is None:
            raise KeyError(task)
        return value

    def loss(self, task: str) -> float:
        """The mean loss of ``task``, or the average's for :data:`AVERAGE`.

        Raises:
            KeyError: for a task the report does not hold, or :data:`AVERAGE` when it has no average.
        """
        if task == AVERAGE:
            if self.average is None:
                raise KeyError(AVERAGE)
            return float(self.average["loss"])
        return self.tasks[task].loss

    def with_run_id(self, run_id: str) -> MetricsReport:
        return MetricsReport(self.tasks, self.average, self.model_info, run_id, self.extra)

    def with_extra(self, extra: Mapping[str, Any]) -> MetricsReport:
        """This report with more entries beside the tasks (e.g. ``calibration_examples_used``)."""
        return MetricsReport(self.tasks, self.average, self.model_info, self.run_id, {**self.extra, **extra})

    def to_json(self) -> dict[str, Any]:
        """The reference run's flat ``metrics.json`` object."""
        data: dict[str, Any] = {}
        if self.model_info is not None:
            data[MODEL_INFO] = dict(self.model_info)
        data.update({name: result.to_json() for name, result in self.tasks.items()})
        data.update(self.extra)
        if self.average is not None:
            data[AVERAGE] = dict(self.average)
        if self.run_id is not None:
            data[RUN_ID] = self.run_id
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str | Path = "metrics.json") -> MetricsReport:
        """Parse a flat ``metrics.json`` object; entries that are not task results are kept in ``extra``.

        Raises:
            RunFolderError: when ``data`` is not an object.
        """
        if not isinstance(data, Mapping):
            raise RunFolderError(where, f"{where} must hold a JSON object (an evaluation report).")
        tasks: dict[str, TaskMetrics] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in RESERVED_TASK_NAMES - {LM_EVAL}:
                continue
            if key != LM_EVAL and is_task_result(value):
                score = score_key(value)
                tasks[key] = TaskMetrics(
                    task_score(value),
                    float(value.get("loss", math.nan)),
                    value.get("num_samples"),
                    {k: v for k, v in value.items() if k not in (*RESULT_KEYS, score, "num_samples")},
                )
            else:
                extra[key] = value
        average = data.get(AVERAGE)
        return cls(
            tasks=tasks,
            average=dict(average) if isinstance(average, Mapping) else None,
            model_info=data.get(MODEL_INFO),
            run_id=data.get(RUN_ID),
            extra=extra,
        )


def gap_closed(expert: float, merged: float, calibrated: float) -> float | None:
    """The share of the expert − merged gap that calibration closed: (calibrated − merged) / (expert − merged).

    1 is the expert's result, 0 the merged model's, a negative share is a loss of ground; the same formula
    holds for a loss (lower is better) and an accuracy (higher is better), since both differences change
    sign together.

    Args:
        expert: The expert's result on its own task.
        merged: The merged model's.
        calibrated: The calibrated model's.

    Returns:
        The share, or None when the merged model is already at the expert's result (no gap to close).
    """
    gap = expert - merged
    if gap == 0 or not math.isfinite(gap):
        return None
    return (calibrated - merged) / gap


def weights_sha256(folder: Path) -> dict[str, str]:
    """The SHA-256 of each safetensors file of a model folder, by its path in the folder (what a report
    that measured the model records as :data:`WEIGHTS_SHA256`)."""
    from featcal.files.hashing import file_sha256

    folder = Path(folder)
    return {f.relative_to(folder).as_posix(): file_sha256(f) for f in sorted(folder.rglob("*.safetensors"))}
