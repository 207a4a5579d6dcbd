"""The recipe recorded beside a merged or calibrated model's weights: what the folder is.

``featcal merge``, ``featcal calibrate`` and a run's merged and calibrated stages write
``featcal_recipe.json`` into the model folder: the model family, the base and the experts, the merging
method and its hyper-parameters, the weight-only repairs applied to the merge since (``featcal
calibrate --method svc``: kind ``repair``), and for a calibrated model its FeatCal parameters, seed,
tasks and the recipe of the merge it started from. A later ``featcal calibrate --merged DIR``, a run started from
``DIR`` (``skip_ta``) and a model card read it to say what ``DIR`` is. Where the method has a mergekit
equivalent, the merge is written as mergekit's ``mergekit_config.yml`` too, so mergekit users read it
as their own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.errors import ModelInputError
from featcal.files.atomic import atomic_write_json, atomic_write_text
from featcal.runfolder.record import FeatCalRecord, MergeRecord
from featcal.tasks import Task
from featcal.version import __version__

RECIPE_FILE = "featcal_recipe.json"
MERGEKIT_FILE = "mergekit_config.yml"
FORMAT = "featcal-model-recipe/1"
MERGE, CALIBRATION, REPAIR = "merge", "calibration", "repair"


@dataclass(frozen=True)
class ModelRecipe:
    """What a merged (``kind`` merge), repaired (``kind`` repair) or calibrated (``kind`` calibration) model
    folder holds.

    Attributes:
        kind: ``merge``, ``repair`` or ``calibration``.
        family: The model family.
        base_model: The base model (a Hub id, or a folder's path).
        experts: Each task's expert, by task name.
        merge: How the merged model came about (for a calibration: the merge it started from, whose
            method is unknown when that folder recorded none).
        featcal: The calibration's parameters (None for a merge).
        seed: The seed of the calibration examples' shuffle (None for a merge).
        featcal_version: The featcal that wrote it.
        calibration_data: For a calibration of text tasks, each task's calibration data, by task name:
            its ``expert``, ``dataset`` (and ``config``, ``revision`` when set), ``split``, text format
            (``text`` or ``prompt`` and ``response``, ``weigh``, ``max_length``) and the ``examples``
            used (see :func:`calibration_entry`); empty otherwise (a CLIP calibration records its tasks
            in its run folder).
        mergekit_config: For a calibration of a merge that only mergekit recorded (a folder with a
            ``mergekit_config.yml`` and no ``featcal_recipe.json``), that file's text as read, so the
            calibrated folder still says how its merge was made; None otherwise.
        output_dtype: The ``--output-dtype`` the weights were written in when it was not ``base``
            (``float32``); None, and absent from the file, for the base's dtype, so such a recipe reads
            (and hashes) as before the option existed.
        repairs: The weight-only repairs applied to the merge, in order, before any calibration: each
            ``{"method": name, "params": hyper-parameters}`` (:mod:`featcal.repairs`); empty, and absent
            from the file, when none was, so other recipes read (and hash) as before.
    """

    kind: str
    family: str
    base_model: str
    experts: Mapping[str, str]
    merge: MergeRecord
    featcal: FeatCalRecord | None = None
    seed: int | None = None
    featcal_version: str = __version__
    extra: Mapping[str, Any] = field(default_factory=dict)
    calibration_data: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    mergekit_config: str | None = None
    output_dtype: str | None = None
    repairs: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT,
            "kind": self.kind,
            "family": self.family,
            "featcal_version": self.featcal_version,
            "base_model": self.base_model,
            "experts": dict(self.experts),
            "merge": self.merge.to_json(),
        }
        if self.featcal is not None:
            data["featcal"] = self.featcal.to_json()
            data["seed"] = self.seed
        if self.calibration_data:  # absent rather than empty: recipes without it read as before
            data["calibration_data"] = {name: dict(entry) for name, entry in self.calibration_data.items()}
        if self.mergekit_config is not None:
            data["mergekit_config"] = self.mergekit_config
        if self.output_dtype is not None:
            data["output_dtype"] = self.output_dtype
        if self.repairs:
            data["repairs"] = [{"method": r["method"], "params": dict(r["params"])} for r in self.repairs]
        return data

    @classmethod
    def from_json(cls, data: Any, where: Path) -> ModelRecipe:
        """Parse a recipe file's contents.

        Raises:
            ModelInputError: naming ``where`` when it is not a featcal model recipe.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ModelInputError(
                str(where), f"{where} is not a featcal model recipe ({FORMAT}): remove it or rewrite it."
            )
        try:
            return cls(
                kind=str(data["kind"]),
                family=str(data["family"]),
                base_model=str(data["base_model"]),
                experts={str(k): str(v) for k, v in data["experts"].items()},
                merge=MergeRecord.from_json(data["merge"], where),
                featcal=FeatCalRecord.from_json(data["featcal"], where) if data.get("featcal") else None,
                seed=data.get("seed"),
                featcal_version=str(data.get("featcal_version", "")),
                calibration_data={str(k): dict(v) for k, v in (data.get("calibration_data") or {}).items()},
                mergekit_config=None if data.get("mergekit_config") is None else str(data["mergekit_config"]),
                output_dtype=None if data.get("output_dtype") is None else str(data["output_dtype"]),
                repairs=tuple(_repair_entry(entry) for entry in data.get("repairs") or ()),
            )
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            raise ModelInputError(str(where), f"{where} is a damaged featcal model recipe ({exc}).") from None


def _repair_entry(entry: Any) -> dict[str, Any]:
    """One entry of a recipe's ``repairs``, checked: a method name and a mapping of hyper-parameters.

    Raises:
        ValueError: when it is not of that form.
    """
    if not isinstance(entry, Mapping) or not isinstance(entry.get("method"), str):
        raise ValueError("each of 'repairs' must be an object with a 'method' name")
    params = entry.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError("the 'params' of a repair must be an object")
    return {"method": entry["method"], "params": dict(params)}


def calibration_entry(task: Task, expert: str | None, examples: int) -> dict[str, Any]:
    """What a calibration recipe records of a text task's calibration data (see
    :attr:`ModelRecipe.calibration_data`).

    Args:
        task: A text task (one with a :class:`~featcal.tasks.TextFormat`).
        expert: Its expert as the calibration named it.
        examples: The calibration examples it used.

    Returns:
        The entry: ``expert``, ``dataset``, ``config`` and ``revision`` when set, ``split``, the text
        format's keys and ``examples``.
    """
    spec = task.dataset
    entry: dict[str, Any] = {"expert": expert, "dataset": spec.path}
    entry.update({k: v for k, v in (("config", spec.name), ("revision", spec.revision)) if v is not None})
    entry["split"] = spec.calibration_split()
    entry.update(task.text.to_dict() if task.text is not None else {})
    entry["examples"] = int(examples)
    return entry


def write_model_recipe(folder: Path, recipe: ModelRecipe) -> None:
    """Write ``featcal_recipe.json`` into ``folder``, and ``mergekit_config.yml`` for a merge whose method
    mergekit knows (see :func:`mergekit_config`)."""
    atomic_write_json(Path(folder) / RECIPE_FILE, recipe.to_json())
    text = mergekit_config(recipe) if recipe.kind == MERGE else None
    if text is not None:
        atomic_write_text(Path(folder) / MERGEKIT_FILE, text)


def read_model_recipe(folder: str | Path) -> ModelRecipe | None:
    """The recipe a model folder records, or None when it records none.

    Raises:
        ModelInputError: when the recipe file is there but unreadable or not featcal's.
    """
    path = Path(folder) / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelInputError(str(path), f"{path} is not readable JSON ({exc}): remove it or rewrite it.") from None
    return ModelRecipe.from_json(data, path)


def mergekit_config(recipe: ModelRecipe) -> str | None:
    """The merge as mergekit's ``mergekit_config.yml``, when its method has a mergekit equivalent.

    Task Arithmetic (θ0 + κ·Σ τ_t) is mergekit's ``task_arithmetic`` with ``weight: κ`` per model;
    Simple Average is mergekit's ``linear`` with equal weights. featcal's TIES takes the top-k of each
    whole task vector, mergekit's the density of each tensor: no equivalent, so no file; nor for Task
    Arithmetic that keeps the embeddings at the base's (``keep_embeddings``).
    """
    import yaml

    from featcal.merging import get_method

    try:
        form = get_method(recipe.merge.method).mergekit
    except KeyError:
        return None
    if form is None or recipe.merge.merged_from is not None:
        return None
    parameters = form.model_parameters(dict(recipe.merge.params))
    if parameters is None:  # these hyper-parameters have no mergekit equivalent
        return None
    models = [{"model": ref, "parameters": dict(parameters)} for ref in recipe.experts.values()]
    config: dict[str, Any] = {"merge_method": form.name, "models": models}
    if form.needs_base:
        config["base_model"] = recipe.base_model
    return yaml.safe_dump(config, sort_keys=True)
