"""``diagnostics.json``: the feature drift of a run's models, its one-line summary, and reading it back.

The file records, for the merged model (``merged``) and the calibrated one (``calibrated``) when
they were measured, the relative drift from each task's expert at each measuring point
(:mod:`featcal.diagnostics.drift` defines it), their sums and means, the split and the number of
images per task, and the ``run_id`` of the run it belongs to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.diagnostics.drift import FeatureDrift
from featcal.errors import RunFolderError
from featcal.files.atomic import atomic_write_json
from featcal.runfolder.layout import DIAGNOSTICS
from featcal.runfolder.reader import read_json_file

logger = logging.getLogger(__name__)

FORMAT = "featcal-diagnostics/1"
MERGED, CALIBRATED = "merged", "calibrated"  # the model names a run's diagnostics use
DEFINITION = (
    "relative drift = sqrt(sum ||f_model - f_expert||^2) / sqrt(sum ||f_expert||^2), sums over the task's "
    "images and every token; f = each encoder layer's output, then the pooled output (post_layernorm of "
    "the CLS token); model and expert t run on the same images of task t"
)
SPLITS = ("test", "calibration")
DEFAULT_NOUN, DEFAULT_HEAD_POINT = "image", "pooled (CLS) output"  # CLIP's words, which DEFINITION speaks


@dataclass(frozen=True)
class DriftReport:
    """A run's feature drift: what was measured, on which images, for which run.

    Attributes:
        drift: The measurement.
        split: ``test`` (the first images of each test split) or ``calibration`` (the run's
            calibration images, from the train split).
        labels: A readable name of each measured model (``Task Arithmetic``, ``Task Arithmetic + FeatCal``).
        stages: The run folder's stage folder of each measured model (``ta``, ``featcal-ta``).
        run_id: The run's recipe hash.
        noun: What one example is called (the family's: ``image``, ``example``).
        head_point: What the last measuring point is called (the family's: ``pooled (CLS) output``).
    """

    drift: FeatureDrift
    split: str
    labels: Mapping[str, str]
    stages: Mapping[str, str]
    run_id: str
    noun: str = DEFAULT_NOUN
    head_point: str = DEFAULT_HEAD_POINT

    def definition(self) -> str:
        """What the drift is, in the words of the measured models' family."""
        if (self.noun, self.head_point) == (DEFAULT_NOUN, DEFAULT_HEAD_POINT):
            return DEFINITION
        return (
            "relative drift = sqrt(sum ||f_model - f_expert||^2) / sqrt(sum ||f_expert||^2), sums over the task's "
            f"{self.noun}s and every token that is not padding; f = the hidden states after each layer, then the "
            f"{self.head_point}; model and expert t run on the same {self.noun}s of task t"
        )

    def summary(self) -> str:
        """One line: the mean layer drift and the pooled drift of each model, and FeatCal's change."""
        d = self.drift
        where = (
            f"mean over {len(d.points) - 1} layers × {len(d.tasks)} tasks, "
            f"{_count_words(d.num_images)} {'test' if self.split == 'test' else 'calibration'} {self.noun}s per task"
        )
        if MERGED in d.drift and CALIBRATED in d.drift:
            before, after = d.mean_layer_drift(MERGED), d.mean_layer_drift(CALIBRATED)
            change = f" ({100 * (after - before) / before:+.0f} %)" if before > 0 else ""
            return (
                f"Feature drift from the experts ({where}): {before:.3f} for {self.labels[MERGED]}, "
                f"{after:.3f} with FeatCal{change}; {self.head_point}: "
                f"{d.mean_pooled_drift(MERGED):.3f} → {d.mean_pooled_drift(CALIBRATED):.3f}."
            )
        (name,) = d.models
        return (
            f"Feature drift of {self.labels[name]} from the experts ({where}): {d.mean_layer_drift(name):.3f}; "
            f"{self.head_point}: {d.mean_pooled_drift(name):.3f}."
        )

    def to_json(self) -> dict[str, Any]:
        d = self.drift
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "definition": self.definition(),
            **({"noun": self.noun} if self.noun != DEFAULT_NOUN else {}),
            **({"head_point": self.head_point} if self.head_point != DEFAULT_HEAD_POINT else {}),
            "split": self.split,
            "images_per_task": dict(d.num_images),
            "points": list(d.points),
            "tasks": list(d.tasks),
            "models": {
                name: {
                    "label": self.labels[name],
                    "stage": self.stages[name],
                    "drift": {task: list(values) for task, values in d.drift[name].items()},
                    "summed_layer_drift": d.summed_layer_drift(name),
                    "mean_layer_drift": d.mean_layer_drift(name),
                    "mean_pooled_drift": d.mean_pooled_drift(name),
                }
                for name in d.models
            },
            "summary": self.summary(),
        }

    @classmethod
    def from_json(cls, data: Any, *, where: Path) -> DriftReport:
        """Parse ``diagnostics.json``.

        Raises:
            RunFolderError: when ``data`` is not a featcal diagnostics report.
        """
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            points, tasks = tuple(data["points"]), tuple(data["tasks"])
            models = data["models"]
            drift = {
                name: {t: tuple(float(v) for v in entry["drift"][t]) for t in tasks} for name, entry in models.items()
            }
            if not drift or any(len(values) != len(points) for m in drift.values() for values in m.values()):
                raise ValueError("drift values do not match the points")
            counts = {t: int(data["images_per_task"][t]) for t in tasks}
            return cls(
                drift=FeatureDrift(points, drift, counts),
                split=str(data["split"]),
                labels={name: str(entry["label"]) for name, entry in models.items()},
                stages={name: str(entry["stage"]) for name, entry in models.items()},
                run_id=str(data["run_id"]),
                noun=str(data.get("noun", DEFAULT_NOUN)),
                head_point=str(data.get("head_point", DEFAULT_HEAD_POINT)),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RunFolderError(
                where, f"{where} is not a featcal diagnostics report ({exc}): run `featcal diagnose` again."
            ) from None


def _count_words(counts: Mapping[str, int]) -> str:
    values = sorted(set(counts.values()))
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def write_report(run: Path, report: DriftReport) -> Path:
    """Write ``<run>/diagnostics.json`` (strict JSON, atomically); returns its path."""
    path = Path(run) / DIAGNOSTICS
    atomic_write_json(path, report.to_json())
    return path


def read_report(run: Path, run_id: str) -> DriftReport | None:
    """The run's diagnostics, or None when it has none or they belong to another recipe (with a warning).

    Raises:
        RunFolderError: when ``diagnostics.json`` is damaged.
    """
    path = Path(run) / DIAGNOSTICS
    if not path.is_file():
        return None
    report = DriftReport.from_json(read_json_file(path, f"Run folder {run}"), where=path)
    if report.run_id != run_id:
        logger.warning(
            "%s belongs to another recipe (run_id %s, the run's is %s): left out; run `featcal diagnose` again",
            path,
            report.run_id[:12],
            run_id[:12],
        )
        return None
    return report
