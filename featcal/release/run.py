"""Read a finished run folder: its recipe, the merged and calibrated stages, metrics and timings.

The layout (written by the pipeline)::

    <run>/run_config.json        the recipe and its hash, ``run_id`` (featcal.io.config_hash of the rest)
    <run>/zero-shot/metrics.json optional: the zero-shot base model (``base/`` is read too)
    <run>/experts/metrics.json   optional: each task's expert on its own task
    <run>/<method>/              merged baseline (``ta`` for Task Arithmetic, else the method name)
    <run>/featcal-<method>/      the calibrated model, when FeatCal ran
    <run>/timings.json           optional: seconds per stage

Each stage folder holds ``config.json``, ``model.safetensors`` and ``metrics.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError
from featcal.io import config_hash
from featcal.pipeline import stage_dir_name
from featcal.tasks import Task, parse_task_table

RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
TIMINGS = "timings.json"


def recipe_sha256(config: Mapping[str, Any]) -> str:
    """The hash naming a recipe: everything in run_config.json but its own ``run_id`` entry.

    It is the ``run_id`` of run_config.json and metrics.json, and ``recipe_sha256`` in the released weights.
    """
    return config_hash({k: v for k, v in config.items() if k != "run_id"})


def read_json_file(path: Path, what: str) -> Any:
    """Parsed JSON, or a FeatcalError naming the file."""
    if not path.is_file():
        raise FeatcalError(f"{what}: {path} is missing.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise FeatcalError(f"{what}: {path} is not valid JSON ({exc}).") from None


@dataclass(frozen=True)
class Stage:
    """One model folder of a run (merged baseline or calibrated) with its evaluation report."""

    name: str
    path: Path
    metrics: Mapping[str, Any]


@dataclass(frozen=True)
class RunFolder:
    """A finished run, validated: the recipe, its hash, stages and metrics."""

    path: Path
    config: Mapping[str, Any]
    recipe_sha256: str
    tasks: tuple[Task, ...]
    merged: Stage | None
    calibrated: Stage | None
    base_metrics: Mapping[str, Any] | None
    expert_metrics: Mapping[str, Any] | None
    timings: Mapping[str, Any]

    @property
    def released(self) -> Stage:
        """The model that is released: the calibrated one when present, else the merged one."""
        stage = self.calibrated or self.merged
        assert stage is not None  # read_run guarantees one of them
        return stage

    @property
    def method(self) -> str:
        return self.config["merge"]["method"]

    @property
    def merge_params(self) -> Mapping[str, Any]:
        return self.config["merge"].get("params") or {}

    @property
    def featcal_params(self) -> Mapping[str, Any] | None:
        return self.config.get("featcal") or None

    @property
    def max_eval_samples(self) -> int | None:
        """Test images per task when the evaluation used only the first ones (None: whole split)."""
        return (self.config.get("evaluation") or {}).get("max_eval_samples")

    @property
    def base_model(self) -> str:
        return self.config["base_model_id"]

    @property
    def experts(self) -> Mapping[str, str]:
        return self.config.get("experts") or {t.name: t.expert for t in self.tasks if t.expert}


def _check_config(config: Any, where: Path) -> None:
    if not isinstance(config, Mapping):
        raise FeatcalError(f"{where} must hold a JSON object (the run's recipe).")
    missing = [k for k in ("base_model_id", "tasks", "tasks_table", "merge") if k not in config]
    if missing:
        raise FeatcalError(f"{where} lacks {missing}: is this a featcal run folder?")
    merge = config["merge"]
    if not isinstance(merge, Mapping) or not isinstance(merge.get("method"), str):
        raise FeatcalError(f"{where}: 'merge' must be an object with a 'method' name.")
    unknown = [t for t in config["tasks"] if t not in config["tasks_table"]]
    if unknown:
        raise FeatcalError(f"{where}: tasks {unknown} have no entry in 'tasks_table'.")
    if "run_id" in config and config["run_id"] != recipe_sha256(config):
        raise FeatcalError(
            f"{where} was edited after the run: its run_id {config['run_id'][:12]} no longer matches its "
            f"contents ({recipe_sha256(config)[:12]}). Restore it, or re-run with the new recipe."
        )


def _read_stage(
    run: Path, name: str, tasks: tuple[Task, ...], recipe_hash: str, *, evaluated: bool = False
) -> Stage | None:
    """The stage folder ``name`` with its metrics; None when absent, or unevaluated and not ``evaluated``."""
    folder = run / name
    if not folder.is_dir() or not (evaluated or (folder / METRICS).is_file()):
        return None
    metrics = read_json_file(folder / METRICS, f"Stage {name!r} of run {run}")
    missing = [
        t.name for t in tasks if not isinstance(metrics.get(t.name), Mapping) or "accuracy" not in metrics[t.name]
    ]
    if missing:
        raise FeatcalError(
            f"{folder / METRICS} has no accuracy for task(s) {missing}: re-run the evaluation of this stage."
        )
    run_id = metrics.get("run_id")
    if run_id is not None and run_id != recipe_hash:
        raise FeatcalError(
            f"{folder / METRICS} belongs to another run (run_id {run_id}) than {run / RUN_CONFIG} "
            f"(recipe {recipe_hash[:12]}): re-run the stage, or use the run folder it came from."
        )
    return Stage(name=name, path=folder, metrics=metrics)


def read_run(path: str | Path) -> RunFolder:
    """Read and check a run folder; at least the merged or the calibrated stage must be there."""
    run = Path(path).expanduser()
    if not run.is_dir():
        raise FeatcalError(f"Run folder {run} does not exist.")
    config = read_json_file(run / RUN_CONFIG, f"Run folder {run}")
    _check_config(config, run / RUN_CONFIG)
    table = parse_task_table({"tasks": config["tasks_table"]}, source=str(run / RUN_CONFIG))
    tasks = tuple(table.select(config["tasks"]))
    recipe_hash = recipe_sha256(config)
    method = config["merge"]["method"]
    merged_name = stage_dir_name(method)
    calibrated = _read_stage(run, f"featcal-{merged_name}", tasks, recipe_hash, evaluated=True)
    # the merged model is released (so must be evaluated) only when there is no calibrated one
    merged = _read_stage(run, merged_name, tasks, recipe_hash, evaluated=calibrated is None)
    if merged is None and calibrated is None:
        raise FeatcalError(
            f"Run folder {run} has neither {merged_name}/ nor featcal-{merged_name}/: "
            "run the merge (and calibration) first."
        )
    base = _read_stage(run, "zero-shot", tasks, recipe_hash) or _read_stage(run, "base", tasks, recipe_hash)
    experts = _read_stage(run, "experts", tasks, recipe_hash)
    timings_file = run / TIMINGS
    timings = read_json_file(timings_file, f"Run folder {run}") if timings_file.is_file() else {}
    return RunFolder(
        path=run,
        config=config,
        recipe_sha256=recipe_hash,
        tasks=tasks,
        merged=merged,
        calibrated=calibrated,
        base_metrics=base.metrics if base else None,
        expert_metrics=experts.metrics if experts else None,
        timings=timings,
    )
