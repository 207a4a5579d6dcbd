"""The stages of a run, over a :class:`~featcal.spec.RunSpec` and a run folder.

merge → evaluate → calibrate → evaluate, each stage writing through :mod:`featcal.runfolder` into
the reference run's layout. Inputs are resolved and checked (tasks, models, datasets, the merge)
before the first file is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from featcal import __version__
from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.checkpoint import Checkpoint, check_compatible, check_same_architecture
from featcal.data import calibration_pixels, load_task_split
from featcal.errors import DatasetInputError, FeatcalError, InvalidParameterError, ModelInputError
from featcal.evaluation import ZeroShotClassifier, check_clip_model_folder, load_base_clip
from featcal.hub import resolve_model_folder
from featcal.io import save_vision_model
from featcal.merging import get_method
from featcal.runfolder import (
    EXPERTS_DIR,
    ZERO_SHOT_DIR,
    MetricsReport,
    calibrated_stage_name,
    merged_stage_name,
    write_run_config,
    write_stage_report,
    write_timings,
)
from featcal.spec import RunSpec
from featcal.tasks import Task, task_table

logger = logging.getLogger(__name__)


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


def run_record(spec: RunSpec, inputs: RunInputs) -> dict[str, Any]:
    """What ``run_config.json`` records: the spec's reproducible part, with tasks and models resolved.

    Its hash is the run's id (``run_id``, and ``recipe_sha256`` in the released weights).
    """
    return {
        "featcal_version": __version__,
        "base_model_id": inputs.base_ref,
        "experts": inputs.expert_refs,
        "tasks": [t.name for t in inputs.tasks],
        "tasks_table": {t.name: t.to_dict() for t in inputs.tasks},
        "seed": spec.seed,
        "merge": {
            "method": spec.merge_method,
            "params": inputs.merge_params,
            "from": spec.ta_model_path if spec.skip_ta else None,
        },
        "featcal": None if spec.skip_featcal else spec.featcal.to_dict(),
        "evaluation": {"max_eval_samples": spec.max_eval_samples},
    }


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` stands for (``auto``: CUDA when torch sees a GPU, else the CPU).

    Raises:
        InvalidParameterError: for a name that is not a device, or CUDA where torch sees no GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidParameterError("device", name, "auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", name, "cpu or auto, since torch sees no GPU")
    return device


def expert_ref(task: Task, pattern: str | None, table_pattern: str | None) -> str:
    """Where task's expert comes from: ``expert_model_format``, else the task's entry, else the table's pattern."""
    if pattern is not None:
        if "{task}" not in pattern:
            raise InvalidParameterError("expert_model_format", pattern, "a pattern containing '{task}'")
        return pattern.format(task=task.name)
    if task.expert:
        return task.expert
    if table_pattern:
        return table_pattern.format(task=task.name)
    raise InvalidParameterError(
        "expert_model_format", None, f"a pattern with '{{task}}', since task {task.name!r} has no 'expert' entry"
    )


def resolve_inputs(spec: RunSpec, *, need_experts: bool = True) -> RunInputs:
    """Tasks, base and experts of a run, validated before anything is written."""
    table = task_table(spec.tasks_file)
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


def validate_datasets(tasks: list[Task], splits: tuple[str, ...] = ("train", "test")) -> None:
    """Load each task's splits once, so a missing split or column, or a label outside the task's
    classes, fails before anything is written (the labels are read from their column alone)."""
    for task in tasks:
        for split in splits:
            check_labels(task, load_task_split(task, split), split)


def check_labels(task: Task, dataset, split: str) -> None:
    """Raise naming the task, split and label when a label lies outside ``[0, number of class names)``."""
    import pyarrow.compute as pc

    bounds = pc.min_max(dataset.data.column(task.dataset.label_column)).as_py()
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


def check_finite(state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise naming the first non-finite tensor of a result computed from finite inputs."""
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FeatcalError(f"{what}: tensor {key!r} is not finite, although every input is.")


def merge(inputs: RunInputs, method: str) -> dict[str, torch.Tensor]:
    """The merged vision tower's state dict."""
    merged = get_method(method)(inputs.base, [inputs.experts[t.name] for t in inputs.tasks], **inputs.merge_params)
    check_finite(merged, f"The {method} merge")
    return merged


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

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelInputError(
            str(folder),
            f"{folder} is not a model folder (no config.json); "
            "pass a folder written by `featcal merge` or `save_pretrained`.",
        )
    checkpoint = Checkpoint(folder)  # raises a clear error for missing or pickle-only weights
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
    return CLIPVisionModel.from_pretrained(str(folder), use_safetensors=True, dtype=torch.float32).eval()


def calibrate(
    inputs: RunInputs,
    merged_model,
    params: FeatCalParams,
    *,
    seed: int,
    device: torch.device,
    processor,
    progress: bool = True,
):
    """The FeatCal-calibrated copy of ``merged_model``."""
    by_name = {t.name: t for t in inputs.tasks}
    model = featcal_calibrate(
        merged_model,
        inputs.base,
        inputs.experts,
        lambda name: calibration_pixels(by_name[name], processor, params.num_calibration_examples, seed),
        params,
        device=device,
        progress=progress,
    )
    check_finite(model.state_dict(), "FeatCal")
    return model


def run_pipeline(spec: RunSpec) -> dict[str, MetricsReport]:
    """Run every stage ``spec`` asks for, writing the run folder ``spec.output_dir``.

    Args:
        spec: The run's options (see :class:`~featcal.spec.RunSpec`).

    Returns:
        The evaluation report of each evaluated stage, by stage folder name (``zero-shot``,
        ``experts``, ``ta``, ``featcal-ta``, …).

    Raises:
        FeatcalError: for any input that cannot be used (typed subclasses name it); raised before
            any file is written whenever the problem can be seen up front.
    """
    device = resolve_device(spec.device)
    torch.manual_seed(spec.seed)
    inputs = resolve_inputs(spec, need_experts=not (spec.skip_ta and spec.skip_featcal and not spec.eval_experts))
    validate_datasets(inputs.tasks, splits=("test",) if spec.skip_featcal else ("train", "test"))
    out = Path(spec.output_dir)
    record = run_record(spec, inputs)
    merged_name, calibrated_name = merged_stage_name(spec.merge_method), calibrated_stage_name(spec.merge_method)
    clip, tokenizer, processor = load_base_clip(inputs.base_folder, device)
    start = time.perf_counter()
    if spec.skip_ta:
        merged_state, merged_model = None, load_vision_folder(spec.ta_model_path, inputs.base)
    else:
        merged_state = merge(inputs, spec.merge_method)
        merged_model = build_vision_model(inputs, merged_state)
    timings: dict[str, float] = {"merge_s": time.perf_counter() - start}
    # Everything is validated, loaded and merged: from here on, files are written.
    run_id = write_run_config(out, record)
    classifier = ZeroShotClassifier(clip, tokenizer, device)
    eval_kwargs = dict(
        batch_size=spec.eval_batch_size,
        num_workers=spec.eval_num_workers,
        max_samples=spec.max_eval_samples,
        progress=spec.progress,
    )
    results: dict[str, MetricsReport] = {}

    if spec.eval_zero_shot:
        results[ZERO_SHOT_DIR] = classifier.evaluate(clip.vision_model, inputs.tasks, processor, **eval_kwargs)
        write_stage_report(out / ZERO_SHOT_DIR, results[ZERO_SHOT_DIR], run_id)
    if spec.eval_experts:
        per_task = {
            task.name: classifier.evaluate_task(
                build_vision_model(inputs, inputs.experts[task.name]), task, processor, **eval_kwargs
            )
            for task in inputs.tasks
        }
        results[EXPERTS_DIR] = MetricsReport.from_results(per_task)
        write_stage_report(out / EXPERTS_DIR, results[EXPERTS_DIR], run_id)

    merge_dir = out / merged_name
    if merged_state is not None:
        save_vision_model(merged_state, inputs.vision_config, merge_dir)
    if not spec.skip_eval_ta:
        start = time.perf_counter()
        results[merged_name] = classifier.evaluate(merged_model, inputs.tasks, processor, **eval_kwargs)
        timings[f"eval_{merged_name}_s"] = time.perf_counter() - start
        if not spec.skip_ta:
            write_stage_report(merge_dir, results[merged_name], run_id)

    if not spec.skip_featcal:
        start = time.perf_counter()
        calibrated = calibrate(
            inputs,
            merged_model,
            spec.featcal,
            seed=spec.seed,
            device=device,
            processor=processor,
            progress=spec.progress,
        )
        timings["calibrate_s"] = time.perf_counter() - start
        save_vision_model(calibrated.state_dict(), inputs.vision_config, out / calibrated_name)
        start = time.perf_counter()
        results[calibrated_name] = classifier.evaluate(calibrated, inputs.tasks, processor, **eval_kwargs)
        timings[f"eval_{calibrated_name}_s"] = time.perf_counter() - start
        write_stage_report(out / calibrated_name, results[calibrated_name], run_id)
    write_timings(out, timings)
    return results
