"""Representation Surgery and ProbSurgery of a CLIP merge folder: embeddings, training, evaluation, the
output folder.

The output folder is not a model: it holds the trained modules (``{repair}_modules.safetensors``:
``surgery_modules.safetensors``, ``probsurgery_modules.safetensors``), the recipe of the merge and its
repairs (``featcal_recipe.json``, kind ``repair``, the last repair with its hyper-parameters and
calibration draw), and ``{repair}_report.json`` (training time, peak memory, loss curve's first and last
steps, and accuracy per task with and without the modules when evaluated). ``featcal export`` and
``push`` refuse it (:func:`check_releasable`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from featcal.errors import ReleaseError
from featcal.files.atomic import atomic_folder
from featcal.memory import GIB, host_peak_bytes
from featcal.model_recipe import RECIPE_FILE, read_model_recipe, write_model_recipe
from featcal.repairs.apply import repair_recipe
from featcal.repairs.catalog import available_repairs, get_repair
from featcal.repairs.probsurgery import MEAN, PROBSURGERY, PROJ, apply_mean, train_probsurgery
from featcal.repairs.registry import Repair
from featcal.repairs.surgery import DOWN, SURGERY, UP, SurgeryResult, apply_module, train_surgery
from featcal.tasks import Task


def modules_file(repair: Repair) -> str:
    """The output folder's modules file of ``repair`` (``surgery_modules.safetensors``)."""
    return f"{repair.name}_modules.safetensors"


def report_file(repair: Repair) -> str:
    """The output folder's report file of ``repair`` (``surgery_report.json``)."""
    return f"{repair.name}_report.json"


MODULES_FILE, REPORT_FILE = modules_file(SURGERY), report_file(SURGERY)


@torch.no_grad()
def embeddings(
    classifier: Any, model: nn.Module, pixels: torch.Tensor, batch_size: int, *, normalised: bool = True
) -> torch.Tensor:
    """The projected image embeddings of ``pixels`` through ``model``, in batches: L2-normalised (the
    classifier's :meth:`~featcal.families.clip_vision.evaluation.ZeroShotClassifier.image_embeddings`,
    FusionBench's Surgery features), or as the projection gives them (``normalised=False``: open_clip's
    ``encode_image``, the ProbSurgery authors' features)."""
    model = model.to(classifier.device).eval()
    if normalised:
        return torch.cat([classifier.image_embeddings(model, batch) for batch in pixels.split(batch_size)])
    project = classifier.clip.visual_projection
    return torch.cat([
        project(model(pixel_values=batch.to(classifier.device)).pooler_output) for batch in pixels.split(batch_size)
    ])  # fmt: skip


class SurgeryFeatures:
    """A task's module as the zero-shot classifier's feature map: z ↦ z − U ReLU(D z)."""

    def __init__(self, modules: Mapping[str, torch.Tensor], task: str, device: torch.device) -> None:
        self.down = modules[f"{task}.{DOWN}"].to(device)
        self.up = modules[f"{task}.{UP}"].to(device)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        return apply_module(features, self.down.to(features.dtype), self.up.to(features.dtype))


class ProbSurgeryFeatures:
    """A task's ProbSurgery module at test time, as the zero-shot classifier's feature map: the mean,
    z ↦ (z − M ReLU(P z)) L2-normalised (the authors' classification head normalises its input).

    The module is trained on unnormalised embeddings and applied here to normalised ones: z − M ReLU(P z) is
    positively homogeneous in z (no biases), so after the normalisation the two give the same features.
    """

    def __init__(self, modules: Mapping[str, torch.Tensor], task: str, device: torch.device) -> None:
        self.proj = modules[f"{task}.{PROJ}"].to(device)
        self.mean = modules[f"{task}.{MEAN}"].to(device)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        revised = apply_mean(features, self.proj.to(features.dtype), self.mean.to(features.dtype))
        return revised / revised.norm(dim=-1, keepdim=True)


@dataclass(frozen=True)
class ModuleRepair:
    """How a per-task module repair trains and is evaluated.

    Attributes:
        train: Its training function (``train(merged, experts, *, seed, **params)``).
        feature_map: ``feature_map(modules, task, device)``: the classifier's test-time feature map.
        normalised: It trains on L2-normalised embeddings (else on the projection's own).
    """

    train: Callable[..., SurgeryResult]
    feature_map: Callable[..., Callable[[torch.Tensor], torch.Tensor]]
    normalised: bool


MODULE_REPAIR_SPECS = {
    SURGERY.name: ModuleRepair(train_surgery, SurgeryFeatures, normalised=True),
    PROBSURGERY.name: ModuleRepair(train_probsurgery, ProbSurgeryFeatures, normalised=False),
}


def run_surgery(
    classifier: Any,
    merged: nn.Module,
    experts: Callable[[str], nn.Module],
    pixels: Mapping[str, torch.Tensor],
    params: Mapping[str, Any],
    *,
    seed: int,
    batch_size: int,
    repair: Repair = SURGERY,
) -> tuple[SurgeryResult, dict[str, float]]:
    """Embed each task's calibration images through the merge and its expert, then train the modules.

    Args:
        classifier: The zero-shot classifier whose projection embeds the images.
        merged: The merged vision tower.
        experts: ``experts(task)``: that task's expert tower, built when called; each is embedded and
            dropped before the next is built, so one expert at a time is in memory.
        pixels: Each task's calibration images (FeatCal's draw), by task name.
        params: The repair's resolved hyper-parameters.
        seed: The calibration seed (initial modules, batch orders and, for ProbSurgery, the noise).
        batch_size: Images per forward batch while embedding.
        repair: Representation Surgery (the default) or ProbSurgery.

    Returns:
        The training's result and its cost: ``seconds`` and ``peak_host_rss_gib``.
    """
    start = time.perf_counter()
    how = MODULE_REPAIR_SPECS[repair.name]
    merged_features = {
        task: embeddings(classifier, merged, pixels[task], batch_size, normalised=how.normalised) for task in pixels
    }
    expert_features = {
        task: embeddings(classifier, experts(task), pixels[task], batch_size, normalised=how.normalised)
        for task in pixels
    }
    result = how.train(merged_features, expert_features, seed=seed, **params)
    cost = {"seconds": time.perf_counter() - start, "peak_host_rss_gib": host_peak_bytes() / GIB}
    return result, cost


def evaluate_surgery(
    classifier: Any,
    merged: nn.Module,
    modules: Mapping[str, torch.Tensor],
    tasks: Sequence[Task],
    images: Any,
    repair: Repair = SURGERY,
) -> dict[str, dict[str, float]]:
    """Accuracy per task of the merge with each task's module applied to its embeddings, and without.

    Args:
        classifier: The zero-shot classifier holding the tasks' heads.
        merged: The merged vision tower.
        modules: The trained modules (Surgery's ``{task}.down``, ``{task}.up``; ProbSurgery's ``{task}.proj``,
            ``.mean``, ``.log_var``).
        tasks: The tasks, each evaluated on its test images.
        images: The tasks' test images (the evaluator's ``test_data``).
        repair: The repair the modules are of (its test-time feature map).

    Returns:
        Per task: ``accuracy`` and ``loss`` (mean cross-entropy) with the module, ``accuracy_without`` and
        ``loss_without`` of the merge alone.
    """
    out: dict[str, dict[str, float]] = {}
    for task in tasks:
        feature_map = MODULE_REPAIR_SPECS[repair.name].feature_map(modules, task.name, classifier.device)
        with_modules = classifier.evaluate_task(merged, task, images=images, progress=False, features=feature_map)
        without = classifier.evaluate_task(merged, task, images=images, progress=False)
        out[task.name] = {
            "accuracy": with_modules.accuracy, "loss": with_modules.loss,
            "accuracy_without": without.accuracy, "loss_without": without.loss,
        }  # fmt: skip
    return out


def save_surgery(
    inputs: Any,
    merged_folder: str | Path,
    recorded: Mapping[str, Any],
    result: SurgeryResult,
    report: Mapping[str, Any],
    output: str | Path,
    repair: Repair = SURGERY,
) -> Path:
    """Write the output folder (atomically): the modules, the recipe and the report.

    Args:
        inputs: The run's resolved inputs (family, base, experts).
        merged_folder: The merge the modules were trained on (its record is kept in the recipe).
        recorded: The repair's hyper-parameters and calibration draw, as the recipe records them.
        result: The trained modules.
        report: What the report file holds.
        output: The folder to write.
        repair: Representation Surgery (the default) or ProbSurgery.

    Returns:
        The folder.
    """
    recipe = repair_recipe(inputs, merged_folder, repair, recorded, "float32")
    with atomic_folder(output) as tmp:
        metadata = {"format": "pt", "repair": repair.name}
        save_file(dict(result.modules), str(tmp / modules_file(repair)), metadata=metadata)
        write_model_recipe(tmp, recipe)
        (tmp / report_file(repair)).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return Path(output)


def check_releasable(folder: str | Path) -> None:
    """Refuse a folder whose recipe records a repair that is not releasable (Representation Surgery, ProbSurgery).

    Raises:
        ReleaseError: naming the repair and why its output is no model.
        ModelInputError: when the folder's recipe is damaged.
    """
    path = Path(folder).expanduser()
    if not (path / RECIPE_FILE).is_file():
        return
    recipe = read_model_recipe(path)
    names = [step.get("method") for step in (recipe.repairs if recipe is not None else ())]
    for repair in [get_repair(name) for name in names if name in available_repairs()]:
        if not repair.releasable:
            raise ReleaseError(
                path, f"{path} holds a {repair.pretty_name} result: per-task modules on top of the merge's "
                "representation, not a transformers model; it is evaluated, not exported or pushed.",
            )  # fmt: skip
