"""The members of the CLIP vision family (:data:`featcal.families.clip_vision.FAMILY`) that are not one function
of its modules as they stand: each imports what it uses when called, so that the family's facts import no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.calibration.adapters import CalibrationBatch
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.clip_vision.evaluation import ZeroShotEvaluator
    from featcal.files.safetensors_writer import ShardedSafetensorsWriter
    from featcal.tasks import Task


def model_config(base_folder: Path) -> Any:
    """The vision tower's configuration of the base (a ``CLIPModel`` or ``CLIPVisionModel`` folder)."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig.from_pretrained(str(base_folder))


def save_model(state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base") -> Path:
    """A ``CLIPVisionModel`` folder holding ``state``, in float32 (the only ``output_dtype``)."""
    from featcal.families.clip_vision.folders import save_vision_model

    return save_vision_model(state, config, folder)


def skeleton(folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The vision tower with its layers on the meta device. The layers run as the merged folder's own config says
    (activation, LayerNorm eps), as they would loaded from it."""
    from featcal.families.clip_vision.adapter import CLIPVisionAdapter
    from featcal.families.clip_vision.folders import vision_skeleton

    return vision_skeleton(model_config(folder), merged, device, CLIPVisionAdapter())


def streamed_model(
    config: Any, folder: Path, *, output_dtype: str = "base"
) -> AbstractContextManager[ShardedSafetensorsWriter]:
    """A ``CLIPVisionModel`` folder written tensor by tensor, in float32 (the only ``output_dtype``)."""
    from featcal.families.clip_vision.folders import streamed_vision_model

    return streamed_vision_model(config, folder)


def check_examples(
    task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
) -> Mapping[str, Any] | None:
    """Decode each image of ``rows``; nothing recorded."""
    from featcal.families.clip_vision.images import check_images

    check_images(task, dataset, split, list(rows))
    return None


def check_split(task: Task, dataset: Any, split: str) -> None:
    """The labels of every row; for the test split, every image too (decoded), so that a damaged one is named
    by its row before any stage is written, not when an evaluation reaches it."""
    from featcal.families.clip_vision.images import check_images, check_labels

    check_labels(task, dataset, split)
    if split == "test":
        check_images(task, dataset, split, list(range(len(dataset))))


def calibration_inputs(task: Task, preprocessor: Any, n: int, seed: int, *, world: World) -> CalibrationBatch:
    """The task's calibration images as pixels (this process's part under torchrun)."""
    from featcal.calibration.adapters import CalibrationBatch
    from featcal.families.clip_vision.adapter import PIXELS
    from featcal.families.clip_vision.images import calibration_pixels

    return CalibrationBatch({PIXELS: calibration_pixels(task, preprocessor, n, seed, world=world)})


def test_inputs(task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
    """The first ``n`` examples of the task's test split (all of them when it has fewer)."""
    from featcal.calibration.adapters import CalibrationBatch
    from featcal.families.clip_vision.adapter import PIXELS
    from featcal.families.clip_vision.images import test_pixels

    return CalibrationBatch({PIXELS: test_pixels(task, preprocessor, n)})


def evaluator(
    base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
) -> ZeroShotEvaluator:
    """The zero-shot evaluator with the base's text tower, holding out what ``settings`` say."""
    from featcal.families.clip_vision.evaluation import ZeroShotEvaluator

    return ZeroShotEvaluator(base_folder, device, world=world, held_out=(settings or {}).get("held_out"))


def evaluation_record() -> Mapping[str, Any]:
    """The image processor the evaluation used."""
    from featcal.families.clip_vision.evaluation import IMAGE_PROCESSOR

    return {"image_processor": IMAGE_PROCESSOR}
