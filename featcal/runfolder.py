"""The run folder: its layout, the typed metrics report, and writing and reading it.

One module owns every name in a run folder; the pipeline writes through it, and export, the card,
the Space and the demo read through it. The layout is the FeatCal reference run's::

    <run>/run_config.json        the resolved recipe and its hash, ``run_id``
    <run>/zero-shot/             optional: metrics of the zero-shot base model (``base/`` is read too)
    <run>/experts/               optional: metrics of each task's expert on its own task
    <run>/<merged>/              the merged model: ``ta`` for Task Arithmetic, else the method's name
    <run>/featcal-<merged>/      the calibrated model, when FeatCal ran
    <run>/timings.json           seconds per stage
    <run>/diagnostics.json       optional: feature drift from the experts (``featcal diagnose``)
    <run>/diagnostics.png        its plot
    <run>/release/               the release folder written by ``featcal export``

Each stage folder holds ``metrics.json`` and ``run.log`` (the same report on one line) and, for
models, ``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.errors import RunFolderError, RunLockedError
from featcal.io import atomic_write_json, config_hash, file_sha256
from featcal.tasks import RESERVED_TASK_NAMES, Task, parse_task_table

RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
RUN_LOG = "run.log"
TIMINGS = "timings.json"
RELEASE_DIR = "release"
ZERO_SHOT_DIR = "zero-shot"
LEGACY_BASE_DIR = "base"
EXPERTS_DIR = "experts"
DIAGNOSTICS = "diagnostics.json"
DIAGNOSTICS_PLOT = "diagnostics.png"
CALIBRATED_PREFIX = "featcal-"
# Keys of a metrics report beside the tasks; task tables refuse tasks with these names.
AVERAGE, MODEL_INFO, RUN_ID = "average", "model_info", "run_id"
# run_config.json's record of a multi-process run (world_size, backend): outside the recipe's hash,
# since the number of processes moves results by float rounding only.
PROCESSES = "processes"
REPORT_KEYS = RESERVED_TASK_NAMES

logger = logging.getLogger(__name__)


def merged_stage_name(method: str) -> str:
    """The folder of a merge: ``ta`` for Task Arithmetic (the reference run's name), else the method."""
    return "ta" if method == "task_arithmetic" else method


def calibrated_stage_name(method: str) -> str:
    """The folder of the FeatCal-calibrated merge: ``featcal-ta`` for Task Arithmetic."""
    return CALIBRATED_PREFIX + merged_stage_name(method)


def recipe_sha256(config: Mapping[str, Any]) -> str:
    """The hash naming a recipe: everything in run_config.json but its own ``run_id`` entry and the
    record of the processes that ran it (:data:`PROCESSES`).

    It is the ``run_id`` of run_config.json and metrics.json, and ``recipe_sha256`` in the released weights.
    """
    return config_hash({k: v for k, v in config.items() if k not in (RUN_ID, PROCESSES)})


# --- the metrics report --------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskMetrics:
    """One task's zero-shot result: accuracy (0..1), mean cross-entropy and the images counted."""

    accuracy: float
    loss: float
    num_samples: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"accuracy": self.accuracy, "loss": self.loss}
        if self.num_samples is not None:
            data["num_samples"] = self.num_samples
        return data


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
        """A report whose average is the plain mean of the tasks' accuracies and losses."""
        count = len(results)
        average = {
            "accuracy": sum(r.accuracy for r in results.values()) / count,
            "loss": sum(r.loss for r in results.values()) / count,
        }
        return cls(tasks=dict(results), average=average, model_info=model_info)

    def accuracy(self, task: str) -> float:
        """The accuracy of ``task``, or the average's for :data:`AVERAGE`."""
        if task == AVERAGE:
            if self.average is None:
                raise KeyError(AVERAGE)
            return float(self.average["accuracy"])
        return self.tasks[task].accuracy

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
            RunFolderError: when ``data`` is not an object or a task entry lacks its accuracy.
        """
        if not isinstance(data, Mapping):
            raise RunFolderError(where, f"{where} must hold a JSON object (an evaluation report).")
        tasks: dict[str, TaskMetrics] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in REPORT_KEYS:
                continue
            if isinstance(value, Mapping) and "accuracy" in value:
                tasks[key] = TaskMetrics(
                    float(value["accuracy"]), float(value.get("loss", math.nan)), value.get("num_samples")
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


# --- writing -------------------------------------------------------------------------------------


def write_run_config(run: Path, record: Mapping[str, Any], *, processes: Mapping[str, Any] | None = None) -> str:
    """Write ``run_config.json`` (the record plus its hash as ``run_id``); returns the run id.

    ``processes``: a multi-process run's ``world_size`` and ``backend``, recorded under
    :data:`PROCESSES` outside the hash; absent for one process.
    """
    run_id = config_hash(record)
    extra = {PROCESSES: dict(processes)} if processes else {}
    atomic_write_json(run / RUN_CONFIG, {**record, **extra, RUN_ID: run_id})
    return run_id


def write_stage_report(folder: Path, report: MetricsReport, run_id: str) -> None:
    """Write a stage's ``metrics.json`` and its one-line twin ``run.log``, both naming the run."""
    data = report.with_run_id(run_id).to_json()
    atomic_write_json(folder / METRICS, data)
    atomic_write_json(folder / RUN_LOG, data, indent=None)


def write_timings(
    run: Path,
    timings: Mapping[str, float],
    memory: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Write ``timings.json``: seconds per stage, rounded to milliseconds; under ``peak_memory`` the
    process's peak memory in GiB (host RSS; on CUDA, ``torch.cuda.max_memory_allocated``) and each
    stage's (see :class:`featcal.memory.MemoryMeter`); under ``settings`` what the run ran with (torch
    threads)."""
    data: dict[str, Any] = {k: round(v, 3) for k, v in timings.items()}
    if memory:
        data["peak_memory"] = _rounded(memory)
    if settings:
        data["settings"] = dict(settings)
    atomic_write_json(run / TIMINGS, data)


def _rounded(value: Any) -> Any:
    """Floats rounded to 3 decimals, through nested mappings."""
    if isinstance(value, Mapping):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


# --- reading -------------------------------------------------------------------------------------


def read_json_file(path: Path, what: str) -> Any:
    """Parsed JSON, or a :class:`RunFolderError` naming the file."""
    if not path.is_file():
        raise RunFolderError(path, f"{what}: {path} is missing.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RunFolderError(path, f"{what}: {path} is not valid JSON ({exc}).") from None


@dataclass(frozen=True)
class Stage:
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
        raise RunFolderError(where, f"{where} must hold a JSON object (the run's recipe).")
    missing = [k for k in ("base_model_id", "tasks", "tasks_table", "merge") if k not in config]
    if missing:
        raise RunFolderError(where, f"{where} lacks {missing}: is this a featcal run folder?")
    merge = config["merge"]
    if not isinstance(merge, Mapping) or not isinstance(merge.get("method"), str):
        raise RunFolderError(where, f"{where}: 'merge' must be an object with a 'method' name.")
    unknown = [t for t in config["tasks"] if t not in config["tasks_table"]]
    if unknown:
        raise RunFolderError(where, f"{where}: tasks {unknown} have no entry in 'tasks_table'.")
    if RUN_ID in config and config[RUN_ID] != recipe_sha256(config):
        raise RunFolderError(
            where,
            f"{where} was edited after the run: its run_id {config['run_id'][:12]} no longer matches its "
            f"contents ({recipe_sha256(config)[:12]}). Restore it, or re-run with the new recipe.",
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
        raise RunFolderError(
            folder / METRICS,
            f"{folder / METRICS} has no accuracy for task(s) {missing}: re-run the evaluation of this stage.",
        )
    run_id = metrics.get(RUN_ID)
    if run_id is not None and run_id != recipe_hash:
        raise RunFolderError(
            folder / METRICS,
            f"{folder / METRICS} belongs to another run (run_id {run_id}) than {run / RUN_CONFIG} "
            f"(recipe {recipe_hash[:12]}): re-run the stage, or use the run folder it came from.",
        )
    return Stage(name=name, path=folder, metrics=metrics)


def read_run(path: str | Path) -> RunFolder:
    """Read and check a finished run folder.

    Args:
        path: The run folder (written by ``featcal run``).

    Returns:
        The run's recipe, tasks, stages and timings. At least the merged or the calibrated stage is there.

    Raises:
        RunFolderError: when the folder or a file in it is missing, damaged, edited after the run, or
            holds metrics of another run.
    """
    run = Path(path).expanduser()
    if not run.is_dir():
        raise RunFolderError(run, f"Run folder {run} does not exist.")
    config = read_json_file(run / RUN_CONFIG, f"Run folder {run}")
    _check_config(config, run / RUN_CONFIG)
    table = parse_task_table({"tasks": config["tasks_table"]}, source=str(run / RUN_CONFIG))
    tasks = tuple(table.select(config["tasks"]))
    recipe_hash = recipe_sha256(config)
    method = config["merge"]["method"]
    merged_name, calibrated_name = merged_stage_name(method), calibrated_stage_name(method)
    calibrated = _read_stage(run, calibrated_name, tasks, recipe_hash, evaluated=True)
    # the merged model is released (so must be evaluated) only when there is no calibrated one
    merged = _read_stage(run, merged_name, tasks, recipe_hash, evaluated=calibrated is None)
    if merged is None and calibrated is None:
        raise RunFolderError(
            run,
            f"Run folder {run} has neither {merged_name}/ nor {calibrated_name}/: "
            "run the merge (and calibration) first.",
        )
    base = _read_stage(run, ZERO_SHOT_DIR, tasks, recipe_hash) or _read_stage(run, LEGACY_BASE_DIR, tasks, recipe_hash)
    experts = _read_stage(run, EXPERTS_DIR, tasks, recipe_hash)
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


# --- writing safely: the lock, the stage ledger, leftovers of killed runs ------------------------

LOCK_FILE = ".featcal.lock"
STAGES_FILE = "stages.json"


class RunLock:
    """An exclusive lock on a run folder, held while a run writes to it.

    The lock is an ``flock`` on ``<run>/.featcal.lock``, which also records the holder (pid, host,
    start time, command). The kernel releases an ``flock`` when its process dies, even by SIGKILL,
    so a lock left by a killed run is taken over (and logged) rather than blocking forever.

    Raises:
        RunLockedError: on entry, when a live process holds the lock.
    """

    def __init__(self, run: Path) -> None:
        self.run = Path(run)
        self.path = self.run / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl
        import os
        import socket
        import sys
        import time

        self.run.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                self.run,
                f"Run folder {self.run} is being written by process {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (since {holder.get('started', '?')}): wait for it to finish, "
                "stop it, or use another output folder.",
                holder,
            ) from None
        previous = _read_holder(fd)
        if previous:
            logger.warning(
                "Run folder %s: taking over the lock left by process %s on %s, which is no longer running",
                self.run,
                previous.get("pid", "?"),
                previous.get("host", "?"),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv[:3]),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl
        import os

        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> dict[str, Any]:
    import os

    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def remove_leftovers(run: Path) -> list[Path]:
    """Remove what killed runs leave behind: hidden temporary files and folders of featcal's writes.

    featcal writes every file and model folder as a hidden temporary (``.name.XXXX``) renamed into
    place; a run killed mid-write leaves one. Only entries of that shape in the run folder and its
    stage folders are removed (the lock file is the caller's). Returns what was removed.
    """
    import shutil

    removed = []
    folders = [run, *(p for p in run.iterdir() if p.is_dir() and not p.name.startswith("."))]
    for folder in folders:
        for entry in folder.iterdir():
            if not entry.name.startswith(".") or entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        logger.info("Removed %d leftover(s) of an interrupted run in %s", len(removed), run)
    return removed


@dataclass
class StageLedger:
    """Which stages of a run folder are finished, from which inputs, and what each wrote.

    Kept in ``<run>/stages.json`` as ``{stage: {"identity": …, "outputs": [relative paths], "weights":
    {relative path: [size, sha256]}}}``. A stage whose recorded identity equals the one a new run
    computes, and whose weight files (``*.safetensors`` among its outputs) are still those it wrote, is
    skipped (an entry without ``weights`` is judged by its identity alone); a stage whose identity
    changed, whose weights were damaged or removed since, or that the new run cannot produce, has its
    outputs removed and is redone.
    With ``writes`` False (the processes of a torchrun run other than rank 0) it is kept in memory
    only: the same decisions, no file touched.
    """

    run: Path
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: bool = True
    _hashes: dict[tuple, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def read(cls, run: Path, *, writes: bool = True) -> StageLedger:
        path = Path(run) / STAGES_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except ValueError:
            data = {}
        entries = {str(k): v for k, v in (data.items() if isinstance(data, dict) else ()) if isinstance(v, dict)}
        return cls(Path(run), entries, writes)

    def is_done(self, stage: str, identity: str) -> bool:
        """Whether ``stage`` finished from inputs ``identity`` and its weight files are as it wrote them."""
        entry = self.done.get(stage) or {}
        if entry.get("identity") != identity:
            return False
        recorded = entry.get("weights")
        return recorded is None or recorded == self._weights(entry.get("outputs", []))

    def mark(self, stage: str, identity: str, outputs: list[str]) -> None:
        """Record ``stage`` as finished from inputs ``identity``, having written ``outputs``."""
        self.done[stage] = {"identity": identity, "outputs": outputs}
        # A process that does not write (torchrun ranks but 0) never reads this entry back in this run;
        # hashing there could race rank 0's rename of the folder into place.
        weights = self._weights(outputs) if self.writes else {}
        if weights:
            self.done[stage]["weights"] = weights
        self._write()

    def _weights(self, outputs: list[str]) -> dict[str, list]:
        """Size and SHA-256 of every ``*.safetensors`` file among ``outputs`` (in them, for folders)."""
        files: list[Path] = []
        for relative in outputs:
            path = self.run / relative
            files += (
                sorted(path.rglob("*.safetensors"))
                if path.is_dir()
                else [path]
                if path.suffix == ".safetensors"
                else []
            )
        return {f.relative_to(self.run).as_posix(): self._size_and_hash(f) for f in files if f.is_file()}

    def _size_and_hash(self, path: Path) -> list:
        """[size, sha256] of a file, hashed once per size and modification time."""
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = file_sha256(path)
        return [stat.st_size, self._hashes[key]]

    def discard(self, stage: str) -> None:
        """Remove ``stage``'s outputs and forget it."""
        import shutil

        entry = self.done.pop(stage, None) or {}
        if not self.writes:
            return
        for relative in entry.get("outputs", []):
            path = self.run / relative
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self._write()

    def _write(self) -> None:
        if self.writes:
            atomic_write_json(self.run / STAGES_FILE, dict(sorted(self.done.items())))


def restamp_report(folder: Path, run_id: str) -> MetricsReport:
    """A finished stage's report, rewritten with ``run_id`` when it names an older recipe."""
    report = MetricsReport.from_json(read_json_file(folder / METRICS, f"Stage {folder.name!r}"), where=folder)
    if report.run_id != run_id:
        write_stage_report(folder, report, run_id)
    return report.with_run_id(run_id)
