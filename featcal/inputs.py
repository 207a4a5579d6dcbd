"""A run's inputs, resolved and checked before anything is written.

Tasks, base and experts (local folders or Hub ids), the device, the datasets (splits, columns,
labels, calibration sizes) and the output folder: every check that can be made up front is made
here, so that a run fails before it writes, with one line naming the input and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from featcal.checkpoint import Checkpoint, check_compatible, check_same_architecture
from featcal.data import load_task_split
from featcal.errors import DatasetInputError, InvalidParameterError, ModelInputError, RunFolderError
from featcal.evaluation import check_clip_model_folder
from featcal.fingerprints import dataset_fingerprint
from featcal.hub import resolve_model_folder
from featcal.merging import get_method
from featcal.runfolder import RUN_CONFIG
from featcal.spec import RunSpec
from featcal.suites import task_table
from featcal.tasks import Task


@dataclass
class RunInputs:
    """A run's resolved inputs: tasks, model folders and lazily-read checkpoints."""

    tasks: list[Task]
    base_ref: str
    base_folder: Path
    expert_refs: dict[str, str]
    experts: dict[str, Checkpoint]
    base: Checkpoint
    merge_params: dict[str, Any]

    @cached_property
    def vision_config(self):
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig.from_pretrained(str(self.base_folder))


def expert_ref(task: Task, pattern: str | None, table_pattern: str | None) -> str:
    """Where task's expert comes from: ``expert_model_format``, else the task's entry, else the table's pattern."""
    if pattern is not None:
        if "{task}" not in pattern:
            raise InvalidParameterError("expert_model_format", pattern, "a pattern containing '{task}'")
        try:
            return pattern.format(task=task.name)
        except (KeyError, IndexError, ValueError):
            raise InvalidParameterError(
                "expert_model_format", pattern, "a pattern whose only field is '{task}' (write '{{' for a brace)"
            ) from None
    if task.expert:
        return task.expert
    if table_pattern:
        return table_pattern.format(task=task.name)
    raise InvalidParameterError(
        "expert_model_format", None, f"a pattern with '{{task}}', since task {task.name!r} has no 'expert' entry"
    )


def resolve_inputs(spec: RunSpec, *, need_experts: bool = True) -> RunInputs:
    """Tasks, base and experts of a run, validated before anything is written."""
    table = task_table(spec.tasks_file, suite=spec.suite, backbone=spec.backbone)
    names = spec.tasks or (list(task_table(spec.tasks_file, replace=True).tasks) if spec.tasks_file else None)
    tasks = table.select(names)
    base_ref = spec.base_model_id or table.base_model
    if not base_ref:
        raise InvalidParameterError("base_model_id", None, "a Hub id or folder, since the task table names none")
    local = Path(base_ref).expanduser()
    base_ref = str(local.resolve()) if local.exists() else base_ref
    base_folder = resolve_model_folder(base_ref, what="base model", cache_dir=spec.cache_dir)
    check_clip_model_folder(base_folder)
    base = Checkpoint(base_folder, name=f"base model {base_ref}")
    base.check_finite()
    refs: dict[str, str] = {}
    experts: dict[str, Checkpoint] = {}
    if need_experts:
        for task in tasks:
            refs[task.name] = expert_ref(task, spec.expert_model_format, table.expert_model_pattern)
            folder = resolve_model_folder(
                refs[task.name], what=f"expert for task {task.name!r}", cache_dir=spec.cache_dir
            )
            experts[task.name] = Checkpoint(folder, name=f"Expert for task {task.name!r} ({refs[task.name]})")
        check_compatible(base, experts)
        for expert in experts.values():
            expert.check_finite()
    method = get_method(spec.merge_method)
    return RunInputs(tasks, base_ref, base_folder, refs, experts, base, method.resolved_params(**spec.method_params()))


@dataclass
class DatasetFacts:
    """What validation learnt about the tasks' datasets: each split's identity, and the calibration
    images each task will use when its train split holds fewer than asked for."""

    fingerprints: dict[str, dict[str, str]]
    calibration_counts: dict[str, int]


def validate_datasets(
    tasks: list[Task],
    splits: tuple[str, ...] = ("train", "test"),
    *,
    calibration_examples: int | None = None,
    allow_fewer: bool = False,
) -> DatasetFacts:
    """Load each task's splits once, so a missing split or column, a label outside the task's
    classes (read from the label column alone), or a train split smaller than
    ``calibration_examples`` fails before anything is written.

    Raises:
        DatasetInputError: naming the task, the split and the fix.
    """
    fingerprints: dict[str, dict[str, str]] = {}
    fewer: dict[str, int] = {}
    for task in tasks:
        for split in splits:
            dataset = load_task_split(task, split)
            check_labels(task, dataset, split)
            fingerprints.setdefault(task.name, {})[split] = dataset_fingerprint(dataset)
            if split == "train" and calibration_examples is not None and len(dataset) < calibration_examples:
                if not allow_fewer:
                    raise DatasetInputError(
                        task.name,
                        task.dataset.path,
                        f"Task {task.name!r}: the train split of {task.dataset.path} has {len(dataset)} images, "
                        f"fewer than the {calibration_examples} calibration images asked for: lower "
                        "`num_calibration_examples`, or set `allow_fewer_calibration_examples` to use them all.",
                    )
                fewer[task.name] = len(dataset)
    return DatasetFacts(fingerprints, fewer)


def check_labels(task: Task, dataset, split: str) -> None:
    """Raise naming the task, split and label when a label lies outside ``[0, number of class names)``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = dataset.data.column(task.dataset.label_column)
    if not (pa.types.is_integer(column.type) or pa.types.is_boolean(column.type)):  # PatchCamelyon's are bool
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the {split} split of {task.dataset.path} has labels of type {column.type} in "
            f"column {task.dataset.label_column!r}; class indices must be integers (or booleans): fix "
            "'label_column' in the tasks file or the dataset.",
        )
    bounds = pc.min_max(column).as_py()
    low, high = int(bounds["min"]), int(bounds["max"])
    if low < 0 or high >= len(task.classnames):
        bad = low if low < 0 else high
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the {split} split of {task.dataset.path} has label {bad}, but the task has "
            f"{len(task.classnames)} class names (labels 0 to {len(task.classnames) - 1}); fix 'classnames' in "
            "the tasks file or the dataset.",
        )


def build_vision_model(inputs: RunInputs, state: Mapping[str, torch.Tensor]):
    """A `CLIPVisionModel` of the base's configuration holding ``state``."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel(inputs.vision_config)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def load_vision_folder(path: str | Path, base: Checkpoint | None = None):
    """A `CLIPVisionModel` from a folder (safetensors only), in float32, its tensors checked.

    Args:
        path: A `CLIPVisionModel` (or `CLIPModel`) folder.
        base: When given, the model must have the base's vision architecture.

    Raises:
        ModelInputError: for a folder without config or safetensors weights, a tensor that is not
            finite (naming file and tensor), or an architecture other than the base's.
    """
    from transformers import CLIPVisionModel

    check_vision_folder(path, base)
    try:
        return CLIPVisionModel.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(
            str(path), f"{path} does not load as a CLIPVisionModel ({first}): its config.json and weights disagree."
        ) from None


def check_vision_folder(path: str | Path, base: Checkpoint | None = None) -> Checkpoint:
    """Check a `CLIPVisionModel` folder as :func:`load_vision_folder` does, without loading the model.

    Args:
        path: A `CLIPVisionModel` (or `CLIPModel`) folder.
        base: When given, the model must have the base's vision architecture.

    Returns:
        The folder's tensors, read lazily.

    Raises:
        ModelInputError: for a folder without config or safetensors weights, a tensor that is not
            finite (naming file and tensor), or an architecture other than the base's.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelInputError(
            str(folder),
            f"{folder} is not a model folder (no config.json); "
            "pass a folder written by `featcal merge` or `save_pretrained`.",
        )
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ModelInputError(
            str(folder), f"{folder / 'config.json'} is not readable JSON: save the model again with `save_pretrained`."
        ) from None
    if model_type not in ("clip_vision_model", "clip"):
        raise ModelInputError(
            str(folder),
            f"{folder} holds a {model_type!r} model, not a CLIP vision tower (model_type 'clip_vision_model' or "
            "'clip'): pass a folder written by `featcal merge` or a CLIP model's `save_pretrained`.",
        )
    checkpoint = Checkpoint(folder)  # raises a clear error for missing or pickle-only weights
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
    return checkpoint


def check_same_run(out: Path, record: Mapping[str, Any]) -> None:
    """Refuse a run folder that holds a run of other tasks or another base model.

    Raises:
        RunFolderError: naming the folder and the differences; ``force`` replaces it instead.
    """
    path = out / RUN_CONFIG
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        old = None
    if not isinstance(old, dict):
        raise RunFolderError(
            out,
            f"The run folder's {path} is damaged (not a JSON object), so what the folder holds is unknown: use "
            "another output folder, or set `force` to replace that run.",
        )
    differs = [key for key in ("tasks", "base_model_id") if old.get(key) != record[key]]
    if differs:
        raise RunFolderError(
            out,
            f"The run folder {out} holds a run with another {' and '.join(differs)}: use another output folder, "
            "or set `force` to replace that run.",
        )
