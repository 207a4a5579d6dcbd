"""A featcal run: merge → evaluate → calibrate → evaluate, each stage writing into a run folder.

Layout (the FeatCal reference run's): ``run_config.json``; ``<merge>/`` (``ta/`` for Task
Arithmetic, else the method name) and ``featcal-<merge>/``, each a `CLIPVisionModel` folder with
``metrics.json`` and ``run.log``; optionally ``zero-shot/`` and ``experts/`` metrics; ``timings.json``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from featcal import __version__
from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.checkpoint import Checkpoint, check_compatible
from featcal.data import calibration_pixels, load_task_split
from featcal.errors import FeatcalError
from featcal.evaluation import ZeroShotClassifier, load_base_clip
from featcal.hub import resolve_model_folder
from featcal.io import atomic_write_json, config_hash, save_vision_model
from featcal.merging import get_method
from featcal.tasks import Task, task_table

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "outputs/clip-vit-b32-ta8"


def default_eval_workers() -> int:
    return min(8, os.cpu_count() or 1)


@dataclass
class RunConfig:
    """Everything a run depends on; field names follow the `featcal run` options."""

    output_dir: str = DEFAULT_OUTPUT_DIR
    device: str = "auto"
    seed: int = 42
    tasks: list[str] | None = None
    tasks_file: str | None = None
    base_model_id: str | None = None
    expert_model_format: str | None = None
    merge_method: str = "task_arithmetic"
    merge_params: dict[str, Any] = field(default_factory=dict)
    featcal: FeatCalParams = field(default_factory=FeatCalParams)
    eval_batch_size: int = 256
    eval_num_workers: int = field(default_factory=default_eval_workers)
    max_eval_samples: int | None = None
    skip_ta: bool = False
    ta_model_path: str | None = None
    skip_eval_ta: bool = False
    skip_featcal: bool = False
    eval_zero_shot: bool = False
    eval_experts: bool = False
    cache_dir: str | None = None
    progress: bool = True

    def recipe(self, setup: Setup) -> dict[str, Any]:
        """The reproducible part of the config, with tasks and models resolved (run_config.json)."""
        return {
            "featcal_version": __version__,
            "base_model_id": setup.base_ref,
            "experts": setup.expert_refs,
            "tasks": [t.name for t in setup.tasks],
            "tasks_table": {t.name: t.to_dict() for t in setup.tasks},
            "seed": self.seed,
            "merge": {
                "method": self.merge_method,
                "params": setup.merge_params,
                "from": self.ta_model_path if self.skip_ta else None,
            },
            "featcal": None if self.skip_featcal else self.featcal.to_dict(),
            "evaluation": {"max_eval_samples": self.max_eval_samples},
        }


@dataclass
class Setup:
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


def stage_dir_name(method: str) -> str:
    return "ta" if method == "task_arithmetic" else method


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise FeatcalError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FeatcalError(f"--device {spec} asked for CUDA, but torch sees no GPU; use --device cpu.")
    return device


def expert_ref(task: Task, pattern: str | None, table_pattern: str | None) -> str:
    """Where task's expert comes from: --expert-model-format, else the task's entry, else the table's pattern."""
    if pattern is not None:
        if "{task}" not in pattern:
            raise FeatcalError(f"--expert-model-format {pattern!r} must contain '{{task}}'.")
        return pattern.format(task=task.name)
    if task.expert:
        return task.expert
    if table_pattern:
        return table_pattern.format(task=task.name)
    raise FeatcalError(f"Task {task.name!r} has no expert: give --expert-model-format or an 'expert' entry.")


def resolve_setup(config: RunConfig, *, need_experts: bool = True) -> Setup:
    """Tasks, base and experts of a run, validated before anything is written."""
    table = task_table(config.tasks_file)
    names = config.tasks or (list(task_table(config.tasks_file, replace=True).tasks) if config.tasks_file else None)
    tasks = table.select(names)
    base_ref = config.base_model_id or table.base_model
    if not base_ref:
        raise FeatcalError("No base model: give --base-model-id or 'base_model' in the tasks file.")
    local = Path(base_ref).expanduser()
    base_ref = str(local.resolve()) if local.exists() else base_ref
    base_folder = resolve_model_folder(base_ref, what="base model", cache_dir=config.cache_dir)
    base = Checkpoint(base_folder, name=f"base model {base_ref}")
    refs: dict[str, str] = {}
    experts: dict[str, Checkpoint] = {}
    if need_experts:
        for task in tasks:
            refs[task.name] = expert_ref(task, config.expert_model_format, table.expert_model_pattern)
            folder = resolve_model_folder(
                refs[task.name], what=f"expert for task {task.name!r}", cache_dir=config.cache_dir
            )
            experts[task.name] = Checkpoint(folder, name=refs[task.name])
        check_compatible(base, experts)
    method = get_method(config.merge_method)
    return Setup(tasks, base_ref, base_folder, refs, experts, base, method.resolved_params(**config.merge_params))


def validate_datasets(tasks: list[Task], splits: tuple[str, ...] = ("train", "test")) -> None:
    """Load each task's splits once, so a missing split or column fails before anything is written."""
    for task in tasks:
        for split in splits:
            load_task_split(task, split)


def check_finite(state: Mapping[str, torch.Tensor], what: str, experts: Mapping[str, Checkpoint] | None = None) -> None:
    """Raise naming the first non-finite tensor (and the expert that holds one, if any)."""
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            culprit = next((t for t, e in (experts or {}).items() if not torch.isfinite(e[key]).all()), None)
            where = f" (expert {culprit!r} has non-finite values there)" if culprit else ""
            raise FeatcalError(f"{what}: tensor {key!r} is not finite{where}.")


def merge(setup: Setup, method: str) -> dict[str, torch.Tensor]:
    """The merged vision tower's state dict."""
    merged = get_method(method)(setup.base, [setup.experts[t.name] for t in setup.tasks], **setup.merge_params)
    check_finite(merged, f"The {method} merge", setup.experts)
    return merged


def build_vision_model(setup: Setup, state: Mapping[str, torch.Tensor]):
    from transformers import CLIPVisionModel

    model = CLIPVisionModel(setup.vision_config)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def load_vision_folder(path: str | Path):
    """A `CLIPVisionModel` from a folder (safetensors only)."""
    from transformers import CLIPVisionModel

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FeatcalError(
            f"{folder} is not a model folder (no config.json); "
            "pass a folder written by `featcal merge` or `save_pretrained`."
        )
    Checkpoint(folder)  # raises a clear error for missing or pickle-only weights
    return CLIPVisionModel.from_pretrained(str(folder), use_safetensors=True).eval()


def calibrate(
    setup: Setup,
    merged_model,
    params: FeatCalParams,
    *,
    seed: int,
    device: torch.device,
    processor,
    progress: bool = True,
):
    """The FeatCal-calibrated copy of ``merged_model``."""
    by_name = {t.name: t for t in setup.tasks}
    model = featcal_calibrate(
        merged_model,
        setup.base,
        setup.experts,
        lambda name: calibration_pixels(by_name[name], processor, params.num_calibration_examples, seed),
        params,
        device=device,
        progress=progress,
    )
    check_finite(model.state_dict(), "FeatCal")
    return model


def _write_report(folder: Path, report: dict, run_id: str) -> None:
    report = {**report, "run_id": run_id}
    atomic_write_json(folder / "metrics.json", report)
    atomic_write_json(folder / "run.log", report, indent=None)


def run_pipeline(config: RunConfig) -> dict[str, dict]:
    """Run every stage the config asks for; returns the metrics of each evaluated stage."""
    if config.skip_ta and not config.ta_model_path:
        raise FeatcalError("--skip-ta needs --ta-model-path (the merged model folder to start from).")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    setup = resolve_setup(config, need_experts=not (config.skip_ta and config.skip_featcal and not config.eval_experts))
    validate_datasets(setup.tasks, splits=("test",) if config.skip_featcal else ("train", "test"))
    out = Path(config.output_dir)
    recipe = config.recipe(setup)
    run_id = config_hash(recipe)
    merge_name = stage_dir_name(config.merge_method)
    start = time.perf_counter()
    merged_state = None if config.skip_ta else merge(setup, config.merge_method)
    timings: dict[str, float] = {"merge_s": time.perf_counter() - start}
    # Everything is validated and merged: from here on, files are written.
    atomic_write_json(out / "run_config.json", {**recipe, "run_id": run_id})
    clip, tokenizer, processor = load_base_clip(setup.base_folder, device)
    classifier = ZeroShotClassifier(clip, tokenizer, device)
    eval_kwargs = dict(
        batch_size=config.eval_batch_size,
        num_workers=config.eval_num_workers,
        max_samples=config.max_eval_samples,
        progress=config.progress,
    )
    results: dict[str, dict] = {}

    if config.eval_zero_shot:
        results["zero-shot"] = classifier.evaluate(clip.vision_model, setup.tasks, processor, **eval_kwargs)
        _write_report(out / "zero-shot", results["zero-shot"], run_id)
    if config.eval_experts:
        report: dict[str, Any] = {}
        for task in setup.tasks:
            expert = build_vision_model(setup, setup.experts[task.name])
            report[task.name] = classifier.evaluate_task(expert, task, processor, **eval_kwargs)
        report["average"] = {
            k: sum(report[t.name][k] for t in setup.tasks) / len(setup.tasks) for k in ("accuracy", "loss")
        }
        results["experts"] = report
        _write_report(out / "experts", report, run_id)

    merge_dir = out / merge_name
    if config.skip_ta:
        merged_model = load_vision_folder(config.ta_model_path)
    else:
        merged_model = build_vision_model(setup, merged_state)
        save_vision_model(merged_state, setup.vision_config, merge_dir)
    if not config.skip_eval_ta:
        start = time.perf_counter()
        results[merge_name] = classifier.evaluate(merged_model, setup.tasks, processor, **eval_kwargs)
        timings[f"eval_{merge_name}_s"] = time.perf_counter() - start
        if not config.skip_ta:
            _write_report(merge_dir, results[merge_name], run_id)

    if not config.skip_featcal:
        start = time.perf_counter()
        calibrated = calibrate(
            setup,
            merged_model,
            config.featcal,
            seed=config.seed,
            device=device,
            processor=processor,
            progress=config.progress,
        )
        timings["calibrate_s"] = time.perf_counter() - start
        cal_name = f"featcal-{merge_name}"
        save_vision_model(calibrated.state_dict(), setup.vision_config, out / cal_name)
        start = time.perf_counter()
        results[cal_name] = classifier.evaluate(calibrated, setup.tasks, processor, **eval_kwargs)
        timings[f"eval_{cal_name}_s"] = time.perf_counter() - start
        _write_report(out / cal_name, results[cal_name], run_id)
    atomic_write_json(out / "timings.json", {k: round(v, 3) for k, v in timings.items()})
    return results
