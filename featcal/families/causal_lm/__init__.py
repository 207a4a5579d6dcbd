"""The causal-LM family: decoder-only language models (``featcal architectures`` lists them), text tasks.

Everything featcal knows of causal LMs lives in this package: task entries (:mod:`.entries`), model folders
(:mod:`.folders`), the calibration's adapter (:mod:`.adapter`), calibration texts (:mod:`.texts`), merges made
by mergekit (:mod:`.mergekit`), and the evaluation on held-out texts (:mod:`.evaluation`, :mod:`.settings`,
:mod:`.answers`) with lm-evaluation-harness beside it (:mod:`.harness`). :data:`FAMILY` is the
:class:`~featcal.families.base.ModelFamily` the rest of featcal uses, declared (:mod:`featcal.families.declared`):
its parts are imported on first use, so looking the family up imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from featcal.families.base import ReleaseParts
from featcal.families.causal_lm.architectures import known
from featcal.families.declared import DeclaredFamily

if TYPE_CHECKING:
    from featcal.runfolder.reader import RunFolder


def _run_metrics(run: RunFolder) -> Mapping[str, Any]:
    """MergeBench's averages of the released stage across the run
    (:func:`~featcal.families.causal_lm.mergebench_eval.card.release_metrics`)."""
    from featcal.families.causal_lm.mergebench_eval.card import release_metrics

    return release_metrics(run)


class CausalLMFamily(DeclaredFamily):
    """Decoder-only causal LMs of transformers 5, calibrated on each expert's texts."""

    name = "causal_lm"
    title = "causal language model"
    task_schema = "text"
    tasks_hint = "--tasks-file FILE whose tasks say `family: causal_lm` (docs/causal-lm.md) and --base-model-id BASE"
    mergekit_module = f"{__name__}.mergekit"
    command_module = f"{__name__}.cli"  # featcal architectures
    # Every decoder-only causal-LM model type of the installed transformers, as probed (:mod:`.architectures`):
    # a folder of a refused one is the family's, and refused with its reason.
    model_types = tuple(t for t, a in known().items() if a.decoder_only)
    noun = "text"
    output_dtypes = ("base", "float32")  # the base's dtype (bfloat16 for most LMs), or float32
    head_point = "last token's final norm"
    release = ReleaseParts(
        model_class="AutoModelForCausalLM",
        pipeline_tag="text-generation",
        tags=("text-generation",),
        files=(),
        task_type="text-generation",
        task_name="Text Generation",
        card_template=(__name__, "run_card.md.j2"),
        folder_card_template=(__name__, "model_card.md.j2"),
        run_as_model_folder=True,
        run_metrics=_run_metrics,
    )
    parts = {
        # tasks
        "task_fields": ".entries:TASK_FIELDS",
        "parse_task_fields": ".entries:parse_task_fields",
        "data_file": ".entries:DATA_FILE",
        # models
        "check_base_folder": ".folders:check_architecture_known",
        "checkpoint": ".folders:lm_checkpoint",
        "model_config": ".folders:load_config",
        "check_like_base": ".folders:check_lm_like_base",
        "check_model_folder": ".folders:check_lm_folder",
        "load_model": ".folders:load_lm_folder",
        "build_model": ".folders:build_lm",
        "save_model": ".folders:save_lm",
        # calibration
        "adapter": ".adapter:DecoderAdapter",
        "skeleton": ".bindings:skeleton",
        "streamed_model": ".folders:streamed_lm",
        "preprocessor": ".texts:base_tokenizer",
        "load_split": ".bindings:load_split",
        "check_examples": ".bindings:check_examples",
        "calibration_inputs": ".texts:calibration_texts",
        "test_inputs": ".texts:first_texts",
        # evaluation
        "evaluator": ".bindings:evaluator",
        "evaluation_settings": ".bindings:evaluation_settings",
        "run_options": ".options:LMEvaluationOptions",
        # release
        "card_context": ".bindings:card_context",
    }


FAMILY = CausalLMFamily()
