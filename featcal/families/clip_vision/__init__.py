"""The CLIP vision family: a ``CLIPModel`` base, ``CLIPVisionModel`` experts and merges, image tasks.

Everything featcal knows of CLIP lives in this package: model folders (:mod:`.folders`), the
calibration's adapter (:mod:`.adapter`), images and labels (:mod:`.images`), zero-shot evaluation with
the base's text tower (:mod:`.evaluation`) and what a release says (:mod:`.release`). :data:`FAMILY`
is the :class:`~featcal.families.base.ModelFamily` the rest of featcal uses; its parts are imported
on first use, so looking the family up imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.families.base import ReleaseParts
from featcal.release.options import DEFAULT_LICENSE

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.clip_vision.evaluation import ZeroShotEvaluator
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec
    from featcal.tasks import Task

PROCESSOR_FILE = "preprocessor_config.json"


class ClipVisionFamily:
    """CLIP's vision tower: merged and calibrated, evaluated zero-shot with the base's text tower."""

    name = "clip_vision"
    title = "CLIP vision tower"
    task_schema = "image"
    tasks_hint = "--suite SUITE (`featcal tasks`) or --tasks-file FILE of image tasks"
    model_types = ("clip", "clip_vision_model")
    noun = "image"
    output_dtypes = ("base",)  # a CLIPVisionModel is written in float32, as featcal computes it
    head_point = "pooled (CLS) output"
    release = ReleaseParts(
        model_class="CLIPVisionModel",
        pipeline_tag="image-feature-extraction",
        tags=("clip", "vision", "image-classification"),
        files=(PROCESSOR_FILE,),
        task_type="image-classification",
        task_name="Image Classification",
        card_template=(__name__, "model_card.md.j2"),
        default_license=DEFAULT_LICENSE,
    )

    # --- models -------------------------------------------------------------------------------
    def check_base_folder(self, folder: Path) -> None:
        from featcal.families.clip_vision.folders import check_clip_model_folder

        check_clip_model_folder(folder)

    def checkpoint(self, folder: Path, name: str | None = None) -> Checkpoint:
        from featcal.families.clip_vision.folders import vision_checkpoint

        return vision_checkpoint(folder, name)

    def model_config(self, base_folder: Path) -> Any:
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig.from_pretrained(str(base_folder))

    def hidden_size(self, config: Any) -> int:
        return int(config.hidden_size)

    def check_like_base(self, folder: Path, base_folder: Path, what: str) -> None:
        from featcal.families.clip_vision.folders import check_vision_like_base

        check_vision_like_base(folder, base_folder, what)

    def check_model_folder(self, folder: Path, base: Checkpoint | None = None) -> Checkpoint:
        from featcal.families.clip_vision.folders import check_vision_folder

        return check_vision_folder(folder, base)

    def load_model(self, folder: Path, base: Checkpoint | None = None) -> nn.Module:
        from featcal.families.clip_vision.folders import load_vision_folder

        return load_vision_folder(folder, base)

    def build_model(self, config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
        from featcal.families.clip_vision.folders import build_vision_model

        return build_vision_model(config, state)

    def save_model(
        self, state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> Path:
        from featcal.families.clip_vision.folders import save_vision_model

        return save_vision_model(state, config, folder)

    # --- calibration --------------------------------------------------------------------------
    def adapter(self) -> LayerAdapter:
        from featcal.families.clip_vision.adapter import CLIPVisionAdapter

        return CLIPVisionAdapter()

    def skeleton(self, folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
        from featcal.families.clip_vision.folders import vision_skeleton

        # The layers run as the merged folder's own config says (activation, LayerNorm eps), as they
        # would loaded from it.
        return vision_skeleton(self.model_config(folder), merged, device, self.adapter())

    def streamed_model(self, config: Any, folder: Path, *, output_dtype: str = "base"):
        from featcal.families.clip_vision.folders import streamed_vision_model

        return streamed_vision_model(config, folder)

    def preprocessor(self, base_folder: Path) -> Any:
        from featcal.families.clip_vision.evaluation import base_image_processor

        return base_image_processor(base_folder)

    def load_split(self, task: Task, split: str) -> Any:
        from featcal.families.clip_vision.images import load_task_split

        return load_task_split(task, split)

    def check_examples(
        self, task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
    ) -> None:
        from featcal.families.clip_vision.images import check_images

        check_images(task, dataset, split, list(rows))

    def check_split(self, task: Task, dataset: Any, split: str) -> None:
        """The labels of every row; for the test split, every image too (decoded), so that a damaged one is named
        by its row before any stage is written, not when an evaluation reaches it."""
        from featcal.families.clip_vision.images import check_images, check_labels

        check_labels(task, dataset, split)
        if split == "test":
            check_images(task, dataset, split, list(range(len(dataset))))

    def calibration_inputs(self, task: Task, preprocessor: Any, n: int, seed: int, *, world: World) -> CalibrationBatch:
        from featcal.calibration.adapters import CalibrationBatch
        from featcal.families.clip_vision.adapter import PIXELS
        from featcal.families.clip_vision.images import calibration_pixels

        return CalibrationBatch({PIXELS: calibration_pixels(task, preprocessor, n, seed, world=world)})

    def test_inputs(self, task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
        """The first ``n`` examples of the task's test split (all of them when it has fewer)."""
        from featcal.calibration.adapters import CalibrationBatch
        from featcal.families.clip_vision.adapter import PIXELS
        from featcal.families.clip_vision.images import test_pixels

        return CalibrationBatch({PIXELS: test_pixels(task, preprocessor, n)})

    # --- evaluation ---------------------------------------------------------------------------
    def evaluator(
        self, base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
    ) -> ZeroShotEvaluator:
        from featcal.families.clip_vision.evaluation import ZeroShotEvaluator

        return ZeroShotEvaluator(base_folder, device, world=world, held_out=(settings or {}).get("held_out"))

    def evaluation_settings(self, spec: RunSpec, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
        """The shuffle that holds the evaluated images out of the calibration's, when some task's calibration reads
        its test split (one split named for both): the seed, the calibration's images that come first, and those
        tasks. None else: a CLIP evaluation then depends on the test images and ``max_eval_samples`` alone."""
        from featcal.data import held_out_setting

        return held_out_setting(spec, tasks)

    def evaluation_record(self) -> Mapping[str, Any]:
        from featcal.families.clip_vision.evaluation import IMAGE_PROCESSOR

        return {"image_processor": IMAGE_PROCESSOR}

    def card_context(self, run: RunFolder) -> Mapping[str, Any]:
        from featcal.families.clip_vision.release import card_context

        return card_context(run)


FAMILY = ClipVisionFamily()
