"""The run record: ``run_config.json``, written and read through one typed class.

A run folder's ``run_config.json`` says what the run is: its model family, base model and experts,
tasks (the whole task table, so a release can be read without the tasks file), seed, merge (method,
hyper-parameters, or the merged folder it started from), FeatCal parameters and evaluation settings.
Its hash is the run's id (``run_id``, and ``recipe_sha256`` in the released weights); under torchrun
the processes that ran it are recorded beside it, outside the hash.

``schema`` says which layout a file has. A file without one (schema 1, written by featcal 0.1 before
the schema was recorded) is converted when read: its fields are those of schema 2 less ``schema``
and ``family`` (always ``clip_vision`` then). A file of a newer schema is refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.calibration.params import FeatCalParams
from featcal.errors import RunFolderError
from featcal.families.registry import DEFAULT_FAMILY
from featcal.files.atomic import atomic_write_json
from featcal.files.hashing import config_hash
from featcal.metrics import CALIBRATION_EXAMPLES_USED, RUN_ID
from featcal.runfolder.layout import RUN_CONFIG

SCHEMA = 2
LEGACY_SCHEMA = 1  # a run_config.json without a "schema" entry
# run_config.json's record of a multi-process run (world_size, backend): outside the recipe's hash,
# since the number of processes moves results by float rounding only.
PROCESSES = "processes"
REQUIRED = ("base_model_id", "tasks", "tasks_table", "merge")


def recipe_sha256(config: Mapping[str, Any]) -> str:
    """The hash naming a recipe: everything in ``run_config.json`` but its own ``run_id`` entry and the
    record of the processes that ran it (:data:`PROCESSES`).

    It is the ``run_id`` of run_config.json and metrics.json, and ``recipe_sha256`` in the released weights.
    """
    return config_hash({k: v for k, v in config.items() if k not in (RUN_ID, PROCESSES)})


@dataclass(frozen=True)
class MergeRecord:
    """How the merged model came about: a method and its hyper-parameters, or an existing merged folder.

    Attributes:
        method: The merging method's registry name; with ``merged_from``, the method the run's stage
            folders are named after (``--merge-method``), which need not be the folder's.
        params: Its hyper-parameters, every one resolved.
        merged_from: The merged model's folder when the run did not merge (``skip_ta``), else None.
        recipe: What that folder's own recipe (``featcal_recipe.json``) says of its merge, ``{"method",
            "params"}``; None when it records none (the merge's method is then unknown).
        calibration: For a method that uses calibration data (RegMean), the draw it merged from:
            ``num_calibration_examples``, ``calibration_batch_size``, ``seed``, and the examples each task
            used where fewer (``calibration_examples_used``); a merged folder's recipe adds each task's
            train split (``datasets``: dataset, split, fingerprint). None for the other methods.
    """

    method: str
    params: Mapping[str, Any] = field(default_factory=dict)
    merged_from: str | None = None
    recipe: Mapping[str, Any] | None = None
    calibration: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"method": self.method, "params": dict(self.params), "from": self.merged_from}
        if self.recipe is not None:
            data["recipe"] = dict(self.recipe)
        if self.calibration is not None:  # absent rather than null: records of data-free merges read as before
            data["calibration"] = dict(self.calibration)
        return data

    @property
    def described(self) -> tuple[str, Mapping[str, Any]]:
        """The method and hyper-parameters of the merged model itself: the run's own merge, or what the
        folder it started from records (``("", {})`` when it records nothing)."""
        if self.merged_from is None:
            return self.method, self.params
        if self.recipe is None:
            return "", {}
        return str(self.recipe.get("method", "")), dict(self.recipe.get("params") or {})

    @classmethod
    def from_json(cls, data: Any, where: Path) -> MergeRecord:
        if not isinstance(data, Mapping) or not isinstance(data.get("method"), str):
            raise RunFolderError(where, f"{where}: 'merge' must be an object with a 'method' name.")
        params = data.get("params") or {}
        if not isinstance(params, Mapping):
            raise RunFolderError(where, f"{where}: 'merge.params' must be an object of hyper-parameters.")
        recipe = data.get("recipe")
        calibration = data.get("calibration")
        if calibration is not None and not isinstance(calibration, Mapping):
            raise RunFolderError(where, f"{where}: 'merge.calibration' must be an object describing the merge's data.")
        return cls(
            data["method"], dict(params), data.get("from"), recipe if isinstance(recipe, Mapping) else None,
            None if calibration is None else dict(calibration),
        )  # fmt: skip


@dataclass(frozen=True)
class FeatCalRecord:
    """The calibration's parameters, and the examples each task used when it had fewer than asked for."""

    params: FeatCalParams
    calibration_examples_used: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = self.params.to_dict()
        if self.calibration_examples_used:
            data[CALIBRATION_EXAMPLES_USED] = dict(self.calibration_examples_used)
        return data

    @classmethod
    def from_json(cls, data: Any, where: Path) -> FeatCalRecord:
        if not isinstance(data, Mapping):
            raise RunFolderError(where, f"{where}: 'featcal' must be an object of FeatCal parameters, or null.")
        values = {k: v for k, v in data.items() if k != CALIBRATION_EXAMPLES_USED}
        try:
            params = FeatCalParams(**values)
        except (TypeError, ValueError) as exc:
            raise RunFolderError(where, f"{where}: its FeatCal parameters are not featcal's ({exc}).") from None
        return cls(params, {str(k): int(v) for k, v in (data.get(CALIBRATION_EXAMPLES_USED) or {}).items()})


@dataclass(frozen=True)
class EvaluationRecord:
    """How the stages were evaluated: on the first ``max_eval_samples`` test examples of each task (None:
    all), with the family's own settings in ``details`` (CLIP's image processor)."""

    max_eval_samples: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"max_eval_samples": self.max_eval_samples, **self.details}

    @classmethod
    def from_json(cls, data: Any) -> EvaluationRecord:
        data = data if isinstance(data, Mapping) else {}
        return cls(data.get("max_eval_samples"), {k: v for k, v in data.items() if k != "max_eval_samples"})


@dataclass(frozen=True)
class RunRecord:
    """What a run is, as ``run_config.json`` records it.

    Attributes:
        featcal_version: The featcal that ran it.
        base_model_id: The base model: a Hub id, or a folder's absolute path.
        experts: Each task's expert, by task name (a Hub id or an absolute path).
        tasks: The tasks, in order.
        tasks_table: Each task's entry as a tasks file gives it (:meth:`featcal.tasks.Task.to_dict`).
        seed: The seed of the calibration examples' shuffle.
        merge: How the merged model came about.
        featcal: FeatCal's parameters; None when the run did not calibrate.
        evaluation: How the stages were evaluated.
        precision: ``float32``, ``tf32`` or ``bf16``.
        suite: The built-in suite, when not the default (``ta8``).
        backbone: The built-in backbone, when not the default (``b32``).
        family: The model family (``clip_vision``).
        schema: The layout of the record (:data:`SCHEMA`).
        hub_commits: The commit each Hub input was read at: ``models`` by reference as given (base and
            experts), ``datasets`` by task. Empty when every input was a local folder.
        output_dtype: The ``--output-dtype`` the stages' weights were written in when not ``base``; None
            (and absent from the file, so the run id is as before the option existed) otherwise.
    """

    featcal_version: str
    base_model_id: str
    experts: Mapping[str, str]
    tasks: tuple[str, ...]
    tasks_table: Mapping[str, Any]
    seed: int
    merge: MergeRecord
    featcal: FeatCalRecord | None
    evaluation: EvaluationRecord = field(default_factory=EvaluationRecord)
    precision: str = "float32"
    suite: str | None = None
    backbone: str | None = None
    family: str = DEFAULT_FAMILY
    schema: int = SCHEMA
    hub_commits: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    output_dtype: str | None = None

    @property
    def run_id(self) -> str:
        """The record's hash (:func:`recipe_sha256` of :meth:`to_json`)."""
        return recipe_sha256(self.to_json())

    @property
    def calibration_examples_used(self) -> Mapping[str, int]:
        """The examples each task used when it had fewer than asked for (empty when none had)."""
        return self.featcal.calibration_examples_used if self.featcal else {}

    def to_json(self) -> dict[str, Any]:
        """The record as ``run_config.json`` holds it (without ``run_id``)."""
        data: dict[str, Any] = {
            "schema": self.schema,
            "family": self.family,
            "featcal_version": self.featcal_version,
            "base_model_id": self.base_model_id,
            "experts": dict(self.experts),
            "tasks": list(self.tasks),
        }
        data.update({k: v for k, v in (("suite", self.suite), ("backbone", self.backbone)) if v is not None})
        data.update(
            {
                "tasks_table": {name: dict(entry) for name, entry in self.tasks_table.items()},
                "seed": self.seed,
                "merge": self.merge.to_json(),
                "featcal": self.featcal.to_json() if self.featcal else None,
                "evaluation": self.evaluation.to_json(),
                "precision": self.precision,
            }
        )
        if self.output_dtype is not None:
            data["output_dtype"] = self.output_dtype
        commits = {kind: dict(refs) for kind, refs in self.hub_commits.items() if refs}
        if commits:  # absent when every input is local, so such a run's record (and id) has no such key
            data["hub_commits"] = commits
        return data

    def commit_of(self, kind: str, key: str | None) -> str | None:
        """The commit the Hub input ``key`` (a model reference, or a task for ``kind="datasets"``) was read at."""
        return self.hub_commits.get(kind, {}).get(key) if key is not None else None

    @classmethod
    def from_json(cls, data: Any, where: str | Path = RUN_CONFIG) -> RunRecord:
        """Read a record (any schema featcal knows, converted to this one).

        Raises:
            RunFolderError: naming ``where`` when the data is not a run record, or is of a newer schema.
        """
        where = Path(where)
        if not isinstance(data, Mapping):
            raise RunFolderError(where, f"{where} must hold a JSON object (the run's record).")
        schema = data.get("schema", LEGACY_SCHEMA)
        if not isinstance(schema, int) or schema > SCHEMA:
            raise RunFolderError(
                where, f"{where} has record schema {schema!r}, newer than this featcal's ({SCHEMA}): upgrade featcal."
            )
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise RunFolderError(where, f"{where} lacks {missing}: is this a featcal run folder?")
        tasks, table = data["tasks"], data["tasks_table"]
        if not isinstance(tasks, list) or not isinstance(table, Mapping):
            raise RunFolderError(where, f"{where}: 'tasks' must be a list and 'tasks_table' an object.")
        unknown = [t for t in tasks if t not in table]
        if unknown:
            raise RunFolderError(where, f"{where}: tasks {unknown} have no entry in 'tasks_table'.")
        featcal = data.get("featcal")
        experts = data.get("experts") or {}
        return cls(
            featcal_version=str(data.get("featcal_version", "")),
            base_model_id=str(data["base_model_id"]),
            experts={str(k): str(v) for k, v in experts.items()} if isinstance(experts, Mapping) else {},
            tasks=tuple(str(t) for t in tasks),
            tasks_table=dict(table),
            seed=int(data.get("seed", 42)),
            merge=MergeRecord.from_json(data["merge"], where),
            featcal=None if featcal is None else FeatCalRecord.from_json(featcal, where),
            evaluation=EvaluationRecord.from_json(data.get("evaluation")),
            precision=str(data.get("precision", "float32")),
            suite=data.get("suite"),
            backbone=data.get("backbone"),
            family=str(data.get("family", DEFAULT_FAMILY)),
            schema=SCHEMA,
            hub_commits=_hub_commits(data.get("hub_commits"), where),
            output_dtype=None if data.get("output_dtype") is None else str(data["output_dtype"]),
        )


def _hub_commits(value: Any, where: Path) -> dict[str, dict[str, str]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise RunFolderError(where, f"{where}: 'hub_commits' must map 'models' and 'datasets' to objects.")
    return {str(kind): {str(k): str(v) for k, v in refs.items()} for kind, refs in value.items()}


def write_run_config(run: Path, record: RunRecord, *, processes: Mapping[str, Any] | None = None) -> str:
    """Write ``run_config.json`` (the record plus its hash as ``run_id``); returns the run id.

    ``processes``: a multi-process run's ``world_size`` and ``backend``, recorded under
    :data:`PROCESSES` outside the hash; absent for one process.
    """
    data = record.to_json()
    run_id = recipe_sha256(data)
    extra = {PROCESSES: dict(processes)} if processes else {}
    atomic_write_json(Path(run) / RUN_CONFIG, {**data, **extra, RUN_ID: run_id})
    return run_id


@dataclass(frozen=True)
class RecordFile:
    """A ``run_config.json`` as read: the typed record, the file's own hash and what else it holds."""

    record: RunRecord
    recipe_sha256: str
    raw: Mapping[str, Any]

    @property
    def processes(self) -> Mapping[str, Any] | None:
        """The processes that ran it, under torchrun."""
        value = self.raw.get(PROCESSES)
        return value if isinstance(value, Mapping) else None


def read_run_config(path: Path, what: str) -> RecordFile:
    """Read and check a ``run_config.json``: valid JSON, a run record, not edited since it was written.

    Args:
        path: The file.
        what: What it belongs to, for messages (``"Run folder runs/x"``).

    Raises:
        RunFolderError: naming the file when it is missing, damaged, not a run record, or edited since
            (its ``run_id`` no longer its hash).
    """
    if not path.is_file():
        raise RunFolderError(path, f"{what}: {path} is missing.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunFolderError(path, f"{what}: {path} is not valid JSON ({exc}).") from None
    record = RunRecord.from_json(raw, path)
    digest = recipe_sha256(raw)
    if RUN_ID in raw and raw[RUN_ID] != digest:
        raise RunFolderError(
            path,
            f"{path} was edited after the run: its run_id {str(raw[RUN_ID])[:12]} no longer matches its "
            f"contents ({digest[:12]}). Restore it, or re-run with the new recipe.",
        )
    return RecordFile(record, digest, raw)
