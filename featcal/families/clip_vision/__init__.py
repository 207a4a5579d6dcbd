"""The CLIP vision family: a ``CLIPModel`` base, ``CLIPVisionModel`` experts and merges, image tasks.

Everything featcal knows of CLIP lives in this package: task entries (:mod:`.entries`), model folders
(:mod:`.folders`), the calibration's adapter (:mod:`.adapter`), images and labels (:mod:`.images`), zero-shot
evaluation with the base's text tower (:mod:`.evaluation`) and what a release says (:mod:`.release`).
:data:`FAMILY` is the :class:`~featcal.families.base.ModelFamily` the rest of featcal uses, declared
(:mod:`featcal.families.declared`): its parts are imported on first use, so looking the family up imports no
torch. The evaluation settings (:func:`featcal.data.held_out_setting`): the shuffle that holds the evaluated
images out of the calibration's, when some task's calibration reads its test split.
"""

from __future__ import annotations

from featcal.families.base import ReleaseParts
from featcal.families.declared import DeclaredFamily
from featcal.release.options import DEFAULT_LICENSE

PROCESSOR_FILE = "preprocessor_config.json"


class ClipVisionFamily(DeclaredFamily):
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
    parts = {
        # tasks
        "task_fields": ".entries:TASK_FIELDS",
        "parse_task_fields": ".entries:parse_task_fields",
        # models
        "check_base_folder": ".folders:check_clip_model_folder",
        "checkpoint": ".folders:vision_checkpoint",
        "model_config": ".bindings:model_config",
        "check_like_base": ".folders:check_vision_like_base",
        "check_model_folder": ".folders:check_vision_folder",
        "load_model": ".folders:load_vision_folder",
        "build_model": ".folders:build_vision_model",
        "save_model": ".bindings:save_model",
        # calibration
        "adapter": ".adapter:CLIPVisionAdapter",
        "skeleton": ".bindings:skeleton",
        "streamed_model": ".bindings:streamed_model",
        "preprocessor": ".evaluation:base_image_processor",
        "load_split": ".images:load_task_split",
        "check_examples": ".bindings:check_examples",
        "check_split": ".bindings:check_split",
        "calibration_inputs": ".bindings:calibration_inputs",
        "test_inputs": ".bindings:test_inputs",
        # evaluation and release
        "evaluator": ".bindings:evaluator",
        "evaluation_settings": "featcal.data:held_out_setting",
        "evaluation_record": ".bindings:evaluation_record",
        "card_context": ".release:card_context",
    }


FAMILY = ClipVisionFamily()
