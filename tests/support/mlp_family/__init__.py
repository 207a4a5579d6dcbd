"""A model family written in the test suite only: a tiny MLP classifier on vectors, a package of its own.

It is the proof that a new family is a new package and touches nothing else: registered at test time
(:func:`register`), it runs ``featcal merge``, ``calibrate``, ``evaluate`` and ``export`` through the CLI.
Its facts are class attributes and its members a table (:class:`featcal.families.declared.DeclaredFamily`), as
the built-in families are written; its task entries say which column holds the vectors and how many classes there
are (:mod:`.entries`).
"""

from __future__ import annotations

from featcal.families.base import ReleaseParts
from featcal.families.declared import DeclaredFamily

MODEL_TYPE = "featcal_test_mlp"


class MLPFamily(DeclaredFamily):
    """Tiny MLP classifiers: a stem, two calibrated blocks and a class head."""

    name = "test_mlp"
    title = "tiny MLP classifier (tests)"
    task_schema = "vector"
    tasks_hint = "--tasks-file FILE whose tasks say `family: test_mlp`, and --base-model-id BASE"
    model_types = (MODEL_TYPE,)
    noun = "vector"
    output_dtypes = ("base",)
    head_point = "class head's input"
    release = ReleaseParts(
        model_class="AutoModel",
        pipeline_tag="tabular-classification",
        tags=("mlp", "tabular-classification"),
        files=(),
        task_type="tabular-classification",
        task_name="Tabular Classification",
        card_template=(__name__, "model_card.md.j2"),
        folder_card_template=(__name__, "model_card.md.j2"),
    )
    parts = {
        "task_fields": ".entries:TASK_FIELDS",
        "parse_task_fields": ".entries:parse_task_fields",
        "check_base_folder": ".model:check_base_folder",
        "checkpoint": ".model:checkpoint",
        "model_config": ".model:model_config",
        "check_like_base": ".model:check_like_base",
        "check_model_folder": ".model:check_model_folder",
        "load_model": ".model:load_model",
        "build_model": ".model:build_model",
        "save_model": ".model:save_model",
        "skeleton": ".model:skeleton",
        "streamed_model": ".model:streamed_model",
        "adapter": ".adapter:MLPAdapter",
        "preprocessor": ".data:preprocessor",
        "load_split": ".data:load_split",
        "check_split": ".data:check_split",
        "calibration_inputs": ".data:calibration_inputs",
        "test_inputs": ".data:test_inputs",
        "evaluator": ".evaluation:MLPEvaluator",
        "evaluation_settings": ".evaluation:evaluation_settings",
    }


FAMILY = MLPFamily()
