"""The seq2seq family: T5 encoder-decoders (T5, FLAN-T5) on text-to-text tasks (GLUE as FusionBench defines it).

Everything featcal knows of T5 lives in this package: model folders (:mod:`.folders`), the calibration's
adapter (:mod:`.adapter`), the tasks' (input, target) pairs (:mod:`.texts`), the evaluation of greedy
generations (:mod:`.evaluation`) and what a release says (:mod:`.release`). :data:`FAMILY` is the
:class:`~featcal.families.base.ModelFamily` the rest of featcal uses; its parts are imported on first use,
so looking the family up imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.families.base import ReleaseParts
from featcal.families.seq2seq.head_warning import untied_head_warning_off

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.seq2seq.evaluation import GenerationEvaluator
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec
    from featcal.tasks import Task


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


class Seq2SeqFamily:
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

    # --- models -------------------------------------------------------------------------------
    def check_base_folder(self, folder: Path) -> None:
        from featcal.families.seq2seq.folders import check_t5_folder_kind

        check_t5_folder_kind(folder)

    def checkpoint(self, folder: Path, name: str | None = None) -> Checkpoint:
        from featcal.families.seq2seq.folders import t5_checkpoint

        return t5_checkpoint(folder, name)

    def model_config(self, base_folder: Path) -> Any:
        from featcal.families.seq2seq.folders import load_config

        return load_config(base_folder)

    def hidden_size(self, config: Any) -> int:
        return int(config.d_model)

    def check_like_base(self, folder: Path, base_folder: Path, what: str) -> None:
        from featcal.families.seq2seq.folders import check_t5_like_base

        check_t5_like_base(folder, base_folder, what)

    def check_model_folder(self, folder: Path, base: Checkpoint | None = None) -> Checkpoint:
        from featcal.families.seq2seq.folders import check_t5_folder

        return check_t5_folder(folder, base)

    def load_model(self, folder: Path, base: Checkpoint | None = None) -> nn.Module:
        from featcal.families.seq2seq.folders import load_t5_folder

        return load_t5_folder(folder, base)

    def build_model(self, config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
        from featcal.families.seq2seq.folders import build_t5

        return build_t5(config, state)

    def save_model(
        self, state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> Path:
        from featcal.families.seq2seq.folders import save_t5

        return save_t5(state, config, folder)

    # --- calibration --------------------------------------------------------------------------
    def adapter(self) -> LayerAdapter:
        from featcal.families.seq2seq.adapter import T5Adapter

        return T5Adapter()

    def skeleton(self, folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
        from featcal.families.seq2seq.folders import t5_skeleton

        return t5_skeleton(self.model_config(folder), merged, device)

    def streamed_model(self, config: Any, folder: Path, *, output_dtype: str = "base"):
        from featcal.families.seq2seq.folders import streamed_t5

        return streamed_t5(config, folder)

    def preprocessor(self, base_folder: Path) -> Any:
        from featcal.families.seq2seq.texts import base_tokenizer

        return base_tokenizer(base_folder)

    def load_split(self, task: Task, split: str) -> Any:
        from featcal.families.seq2seq.texts import load_pair_split

        return load_pair_split(task, split)

    def check_examples(
        self, task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
    ) -> Mapping[str, Any] | None:
        from dataclasses import asdict

        from featcal.families.seq2seq.texts import check_pairs

        facts = check_pairs(task, dataset, rows, preprocessor)
        return None if facts is None else asdict(facts)

    def check_split(self, task: Task, dataset: Any, split: str) -> None:
        """Nothing beyond what :meth:`load_split` checks (columns, and the classes ``labels`` names)."""

    def calibration_inputs(self, task: Task, preprocessor: Any, n: int, seed: int, *, world: World) -> CalibrationBatch:
        from featcal.families.seq2seq.texts import calibration_pairs

        return calibration_pairs(task, preprocessor, n, seed, world=world)

    def test_inputs(self, task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
        from featcal.families.seq2seq.texts import first_pairs

        return first_pairs(task, preprocessor, n)

    # --- evaluation and release ---------------------------------------------------------------
    def evaluator(
        self, base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
    ) -> GenerationEvaluator:
        from featcal.families.seq2seq.evaluation import GenerationEvaluator

        return GenerationEvaluator(base_folder, device, world=world, held_out=(settings or {}).get("held_out"))

    def evaluation_settings(self, spec: RunSpec, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
        """The shuffle that holds the evaluated rows out of the calibration's, when some task's calibration reads
        its test split (one local file, or one split named for both): the seed, the calibration's rows that come
        first, and those tasks. None else: a T5 evaluation then depends on the test pairs and
        ``max_eval_samples`` alone (its generation settings are FusionBench's, fixed, and recorded by
        :meth:`evaluation_record`)."""
        from featcal.data import held_out_setting

        return held_out_setting(spec, tasks)

    def evaluation_record(self) -> Mapping[str, Any]:
        from featcal.families.seq2seq.evaluation import GENERATION

        return {"generation": dict(GENERATION)}

    def card_context(self, run: RunFolder) -> Mapping[str, Any]:
        from featcal.families.seq2seq.release import card_context

        return card_context(run)


FAMILY = Seq2SeqFamily()
