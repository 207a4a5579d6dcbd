"""Reading a finished run folder back: its record, stages and metrics, checked.

Export, the card, the Space, sweep and diagnose read a run through :func:`read_run`; the pipeline
reads the folder it resumes through :func:`check_same_run` and :func:`restamp_report`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.errors import RunFolderError
from featcal.files.model_files import MODEL_CONFIG
from featcal.metrics import RUN_ID, MetricsReport, is_task_result
from featcal.runfolder.layout import (
    EXPERTS_DIR,
    LEGACY_BASE_DIR,
    METRICS,
    RUN_CONFIG,
    TIMINGS,
    ZERO_SHOT_DIR,
    calibrated_stage_name,
    merged_stage_name,
)
from featcal.runfolder.record import RunRecord, read_run_config
from featcal.tasks import Task, parse_task_table


def read_json_file(path: Path, what: str) -> Any:
    """Parsed JSON, or a :class:`RunFolderError` naming the file.

    Args:
        path: The file.
        what: What it belongs to, for the message (``"Run folder runs/x"``).
    """
    if not path.is_file():
        raise RunFolderError(path, f"{what}: {path} is missing.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunFolderError(path, f"{what}: {path} is not valid JSON ({exc}).") from None


@dataclass(frozen=True)
class StageFolder:
    """One model folder of a run (merged baseline or calibrated) with its evaluation report."""

    name: str
    path: Path
    metrics: Mapping[str, Any]

    @property
    def report(self) -> MetricsReport:
        """The stage's ``metrics.json`` as a typed report."""
        return MetricsReport.from_json(self.metrics, where=self.path / METRICS)


@dataclass(frozen=True)
class RunFolder:
    """A finished run, validated: the record, its hash, stages and metrics.

    Attributes:
        path: The run folder.
        record: Its ``run_config.json``, typed.
        recipe_sha256: The run's id: the hash of ``run_config.json`` as written.
        raw_config: ``run_config.json`` as written (what a release publishes, converted to nothing).
        tasks: The tasks, from the record's task table.
        merged: The merged model's stage, when the folder holds it (evaluated, or released).
        calibrated: The calibrated model's stage, when the folder holds it.
        base_metrics: The zero-shot base's ``metrics.json``, when evaluated.
        expert_metrics: The experts' ``metrics.json``, when evaluated.
        timings: ``timings.json``.
    """

    path: Path
    record: RunRecord
    recipe_sha256: str
    raw_config: Mapping[str, Any]
    tasks: tuple[Task, ...]
    merged: StageFolder | None
    calibrated: StageFolder | None
    base_metrics: Mapping[str, Any] | None
    expert_metrics: Mapping[str, Any] | None
    timings: Mapping[str, Any]

    @property
    def released(self) -> StageFolder:
        """The model that is released: the calibrated one when present, else the merged one."""
        stage = self.calibrated or self.merged
        assert stage is not None  # read_run guarantees one of them
        return stage

    @property
    def method(self) -> str:
        return self.record.merge.method

    @property
    def merge_params(self) -> Mapping[str, Any]:
        return self.record.merge.params

    @property
    def max_eval_samples(self) -> int | None:
        """Test examples per task when the evaluation used only the first ones (None: whole split)."""
        return self.record.evaluation.max_eval_samples

    @property
    def base_model(self) -> str:
        return self.record.base_model_id

    @property
    def experts(self) -> Mapping[str, str]:
        return self.record.experts or {t.name: t.expert for t in self.tasks if t.expert}


def _read_stage(
    run: Path, name: str, tasks: tuple[Task, ...], recipe_hash: str, *, evaluated: bool = False
) -> StageFolder | None:
    """The stage folder ``name`` with its metrics; None when absent, or unevaluated and not ``evaluated``."""
    folder = run / name
    if not folder.is_dir() or not (evaluated or (folder / METRICS).is_file()):
        return None
    metrics = read_json_file(folder / METRICS, f"Stage {name!r} of run {run}")
    if not isinstance(metrics, Mapping):
        raise RunFolderError(folder / METRICS, f"{folder / METRICS} must hold a JSON object (an evaluation report).")
    missing = [t.name for t in tasks if not is_task_result(metrics.get(t.name))]
    if missing:
        raise RunFolderError(
            folder / METRICS,
            f"{folder / METRICS} has no accuracy for task(s) {missing} (nor a language task's loss): re-run the "
            "evaluation of this stage.",
        )
    run_id = metrics.get(RUN_ID)
    if run_id is not None and run_id != recipe_hash:
        raise RunFolderError(
            folder / METRICS,
            f"{folder / METRICS} belongs to another run (run_id {run_id}) than {run / RUN_CONFIG} "
            f"(recipe {recipe_hash[:12]}): re-run the stage, or use the run folder it came from.",
        )
    return StageFolder(name=name, path=folder, metrics=metrics)


def read_run(path: str | Path) -> RunFolder:
    """Read and check a finished run folder.

    Args:
        path: The run folder (written by ``featcal run``).

    Returns:
        The run's record, tasks, stages and timings. At least the merged or the calibrated stage is there.

    Raises:
        RunFolderError: when the folder or a file in it is missing, damaged, edited after the run, or
            holds metrics of another run.
    """
    run = Path(path).expanduser()
    if not run.is_dir():
        raise RunFolderError(run, f"Run folder {run} does not exist.")
    read = read_run_config(run / RUN_CONFIG, f"Run folder {run}")
    record = read.record
    table = parse_task_table({"tasks": record.tasks_table}, source=str(run / RUN_CONFIG))
    tasks = tuple(table.select(list(record.tasks)))
    merged_name, calibrated_name = merged_stage_name(record.merge.method), calibrated_stage_name(record.merge.method)
    calibrated = _read_stage(run, calibrated_name, tasks, read.recipe_sha256, evaluated=True)
    # the merged model is released (so must be evaluated) only when there is no calibrated one
    merged = _read_stage(run, merged_name, tasks, read.recipe_sha256, evaluated=calibrated is None)
    if merged is None and calibrated is None:
        raise RunFolderError(
            run,
            f"Run folder {run} has neither {merged_name}/ nor {calibrated_name}/: "
            "run the merge (and calibration) first.",
        )
    base = _read_stage(run, ZERO_SHOT_DIR, tasks, read.recipe_sha256) or _read_stage(
        run, LEGACY_BASE_DIR, tasks, read.recipe_sha256
    )
    experts = _read_stage(run, EXPERTS_DIR, tasks, read.recipe_sha256)
    timings_file = run / TIMINGS
    timings = read_json_file(timings_file, f"Run folder {run}") if timings_file.is_file() else {}
    return RunFolder(
        path=run,
        record=record,
        recipe_sha256=read.recipe_sha256,
        raw_config=read.raw,
        tasks=tasks,
        merged=merged,
        calibrated=calibrated,
        base_metrics=base.metrics if base else None,
        expert_metrics=experts.metrics if experts else None,
        timings=timings,
    )


def merged_model_folder(run: RunFolder) -> tuple[str, Path] | None:
    """The run's merged model: its stage folder, else the folder it was taken from (``skip_ta``), as
    ``(name, folder)``; None when the run folder holds no merged model and names none that exists."""
    name = merged_stage_name(run.method)
    folder = run.path / name
    if (folder / MODEL_CONFIG).is_file():
        return name, folder
    source = run.record.merge.merged_from
    if source and (Path(source) / MODEL_CONFIG).is_file():
        return Path(source).name, Path(source)
    return None


def check_same_run(out: Path, tasks: list[str], base_model_id: str) -> None:
    """Refuse a run folder that holds a run of other tasks or another base model.

    Raises:
        RunFolderError: naming the folder and the differences; ``force`` replaces it instead.
    """
    path = out / RUN_CONFIG
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict):
        raise RunFolderError(
            out,
            f"The run folder's {path} is damaged (not a JSON object), so what the folder holds is unknown: use "
            "another output folder, or set `force` to replace that run.",
        )
    differs = [key for key, new in (("tasks", tasks), ("base_model_id", base_model_id)) if old.get(key) != new]
    if differs:
        raise RunFolderError(
            out,
            f"The run folder {out} holds a run with another {' and '.join(differs)}: use another output folder, "
            "or set `force` to replace that run.",
        )
