"""The seq2seq family: T5 encoder-decoders (T5, FLAN-T5) on text-to-text tasks (GLUE as FusionBench defines it).

Everything featcal knows of T5 lives in this package: model folders (:mod:`.folders`), the calibration's
adapter (:mod:`.adapter`), task entries (:mod:`.entries`), the tasks' (input, target) pairs (:mod:`.texts`), the
evaluation of greedy generations (:mod:`.evaluation`) and what a release says (:mod:`.release`). :data:`FAMILY` is
the :class:`~featcal.families.base.ModelFamily` the rest of featcal uses, declared
(:mod:`featcal.families.declared`): its parts are imported on first use, so looking the family up imports no
torch. Its evaluation settings (:func:`featcal.data.held_out_setting`) are the shuffle that holds the evaluated
rows out of the calibration's when some task's calibration reads its test split; else a T5 evaluation depends on
the test pairs and ``max_eval_samples`` alone (its generation settings are FusionBench's, fixed, and recorded).
"""

from __future__ import annotations

from typing import Any

from featcal.families.base import ReleaseParts
from featcal.families.declared import DeclaredFamily
from featcal.families.seq2seq.head_warning import untied_head_warning_off

# What a release holds from the base's tokenizer and the model's generation config (beside config.json and the
# weights): the tokenizer's two files always; the others when transformers writes them (a sentencepiece T5's
# spiece.model, a generation config).
RELEASE_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_RELEASE_FILES = (
    "generation_config.json", "special_tokens_map.json", "spiece.model", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip


def release_config(config: dict[str, Any]) -> dict[str, Any]:
    """A released ``config.json`` that transformers 4 reads as transformers 5 does.

    transformers 5 writes every T5 configuration with ``tie_word_embeddings: true`` and records a FLAN-T5's (a T5
    v1.1's: an LM head of its own, decoder outputs not rescaled) as ``scale_decoder_outputs: false``; transformers 4
    knows only ``tie_word_embeddings``, and would tie the head to the embedding and rescale. Such a configuration
    is written back with ``tie_word_embeddings: false``, as FLAN-T5's own configuration says, which transformers 5
    reads as the same model. A T5 v1.0 configuration (tied, rescaled) is left as it is.

    Args:
        config: The configuration transformers 5 wrote.

    Returns:
        The configuration to release.
    """
    if config.get("model_type") == "t5" and config.get("scale_decoder_outputs") is False:
        return {**config, "tie_word_embeddings": False}
    return config


class Seq2SeqFamily(DeclaredFamily):
    """T5 encoder-decoders of transformers 5, calibrated on each expert's (input, target) pairs."""

    name = "seq2seq"
    title = "T5 encoder-decoder"
    task_schema = "pair"
    tasks_hint = (
        "--tasks-file FILE whose tasks say `family: seq2seq` (docs/seq2seq.md) and --base-model-id BASE, "
        "or --suite glue8 for FLAN-T5-base"
    )
    model_types = ("t5",)
    output_dtypes = ("base",)  # a T5 is written in float32, FLAN-T5's own dtype (its wo overflows in float16)
    noun = "example"
    head_point = "decoder's final norm at its first position"
    release = ReleaseParts(
        model_class="T5ForConditionalGeneration",
        pipeline_tag="text2text-generation",
        tags=("t5", "text2text-generation"),
        files=RELEASE_FILES,
        task_type="text2text-generation",
        task_name="Text2Text Generation",
        card_template=(__name__, "model_card.md.j2"),
        optional_files=OPTIONAL_RELEASE_FILES,
        edit_config=release_config,
        folder_card_template=(__name__, "folder_card.md.j2"),
        quiet_loading=untied_head_warning_off,
    )

    parts = {
        # tasks
        "task_fields": ".entries:TASK_FIELDS",
        "parse_task_fields": ".entries:parse_task_fields",
        "data_file": ".entries:DATA_FILE",
        # models
        "check_base_folder": ".folders:check_t5_folder_kind",
        "checkpoint": ".folders:t5_checkpoint",
        "model_config": ".folders:load_config",
        "hidden_size": ".bindings:hidden_size",
        "check_like_base": ".folders:check_t5_like_base",
        "check_model_folder": ".folders:check_t5_folder",
        "load_model": ".folders:load_t5_folder",
        "build_model": ".folders:build_t5",
        "save_model": ".bindings:save_model",
        # calibration
        "adapter": ".adapter:T5Adapter",
        "skeleton": ".bindings:skeleton",
        "streamed_model": ".bindings:streamed_model",
        "preprocessor": ".texts:base_tokenizer",
        "load_split": ".texts:load_pair_split",
        "check_examples": ".bindings:check_examples",
        "calibration_inputs": ".texts:calibration_pairs",
        "test_inputs": ".texts:first_pairs",
        # evaluation and release
        "evaluator": ".bindings:evaluator",
        "evaluation_settings": "featcal.data:held_out_setting",
        "evaluation_record": ".bindings:evaluation_record",
        "card_context": ".release:card_context",
    }


FAMILY = Seq2SeqFamily()
