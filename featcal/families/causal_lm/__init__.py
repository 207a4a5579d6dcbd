"""The causal-LM family: decoder-only language models (``featcal architectures`` lists them), text tasks.

Everything featcal knows of causal LMs lives in this package: model folders (:mod:`.folders`), the
calibration's adapter (:mod:`.adapter`), calibration texts (:mod:`.texts`), merges made by mergekit
(:mod:`.mergekit`), and the evaluation on held-out texts (:mod:`.evaluation`, :mod:`.settings`,
:mod:`.answers`) with lm-evaluation-harness beside it (:mod:`.harness`). :data:`FAMILY` is the
:class:`~featcal.families.base.ModelFamily` the rest of featcal uses; its parts are imported on first
use, so looking the family up imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.families.base import ReleaseParts
from featcal.families.causal_lm.architectures import known

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.causal_lm.evaluation import HeldOutEvaluator
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec
    from featcal.tasks import Task


class CausalLMFamily:
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
        card_template=(__name__, "model_card.md.j2"),
        folder_card_template=(__name__, "model_card.md.j2"),
        run_as_model_folder=True,
    )

    # --- tasks --------------------------------------------------------------------------------
    def answer_rule_problem(self, rule: str) -> str | None:
        from featcal.families.causal_lm.answers import answer_rule_problem

        return answer_rule_problem(rule)

    # --- models -------------------------------------------------------------------------------
    def check_base_folder(self, folder: Path) -> None:
        from featcal.families.causal_lm.folders import check_architecture_known

        check_architecture_known(folder)

    def checkpoint(self, folder: Path, name: str | None = None) -> Checkpoint:
        from featcal.families.causal_lm.folders import lm_checkpoint

        return lm_checkpoint(folder, name)

    def model_config(self, base_folder: Path) -> Any:
        from featcal.families.causal_lm.folders import load_config

        return load_config(base_folder)

    def hidden_size(self, config: Any) -> int:
        return int(config.hidden_size)

    def check_like_base(self, folder: Path, base_folder: Path, what: str) -> None:
        from featcal.families.causal_lm.folders import check_lm_like_base

        check_lm_like_base(folder, base_folder, what)

    def check_model_folder(self, folder: Path, base: Checkpoint | None = None) -> Checkpoint:
        from featcal.families.causal_lm.folders import check_lm_folder

        return check_lm_folder(folder, base)

    def load_model(self, folder: Path, base: Checkpoint | None = None) -> nn.Module:
        from featcal.families.causal_lm.folders import load_lm_folder

        return load_lm_folder(folder, base)

    def build_model(self, config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
        from featcal.families.causal_lm.folders import build_lm

        return build_lm(config, state)

    def save_model(
        self, state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> Path:
        from featcal.families.causal_lm.folders import save_lm

        return save_lm(state, config, folder, output_dtype=output_dtype)

    # --- calibration --------------------------------------------------------------------------
    def adapter(self) -> LayerAdapter:
        from featcal.families.causal_lm.adapter import DecoderAdapter

        return DecoderAdapter()

    def skeleton(self, folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
        from featcal.families.causal_lm.folders import lm_skeleton

        return lm_skeleton(self.model_config(folder), merged, device)

    def streamed_model(self, config: Any, folder: Path, *, output_dtype: str = "base"):
        from featcal.families.causal_lm.folders import streamed_lm

        return streamed_lm(config, folder, output_dtype=output_dtype)

    def preprocessor(self, base_folder: Path) -> Any:
        from featcal.families.causal_lm.texts import base_tokenizer

        return base_tokenizer(base_folder)

    def load_split(self, task: Task, split: str) -> Any:
        """The task's calibration split, for ``train`` and ``test`` alike: its evaluation reads rows held out
        of it (:mod:`featcal.families.causal_lm.evaluation`)."""
        from featcal.families.causal_lm.texts import load_text_split

        return load_text_split(task)

    def check_examples(
        self, task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
    ) -> Mapping[str, Any] | None:
        from dataclasses import asdict

        from featcal.families.causal_lm.texts import check_texts

        facts = check_texts(task, dataset, rows, preprocessor)
        return None if facts is None else asdict(facts)

    def check_split(self, task: Task, dataset: Any, split: str) -> None:
        """Nothing beyond what :meth:`load_split` checks: a text task's rows carry no labels."""

    def calibration_inputs(self, task: Task, preprocessor: Any, n: int, seed: int, *, world: World) -> CalibrationBatch:
        from featcal.families.causal_lm.texts import calibration_texts

        return calibration_texts(task, preprocessor, n, seed, world=world)

    def test_inputs(self, task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
        from featcal.families.causal_lm.texts import first_texts

        return first_texts(task, preprocessor, n)

    # --- evaluation and release ---------------------------------------------------------------
    def evaluator(
        self, base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
    ) -> HeldOutEvaluator:
        """The held-out evaluator of the run (:class:`~featcal.families.causal_lm.evaluation.HeldOutEvaluator`).

        Raises:
            TypeError: without ``settings`` (:meth:`evaluation_settings`'s).
        """
        from featcal.families.causal_lm.evaluation import HeldOutEvaluator

        if settings is None:
            raise TypeError("a language model's evaluator needs its settings (evaluation_settings)")
        return HeldOutEvaluator(base_folder, device, world=world, settings=settings)

    def evaluation_settings(self, spec: RunSpec, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
        """The held-out rows' shuffle, the greedy answers' length and the harness's tasks
        (:class:`~featcal.families.causal_lm.settings.LMEvaluationSettings`)."""
        from featcal.families.causal_lm.settings import evaluation_settings

        return evaluation_settings(spec).to_json()

    def evaluation_record(self) -> Mapping[str, Any]:
        return {}

    def card_context(self, run: RunFolder) -> Mapping[str, Any]:
        """MergeBench's scores: the card's section, ``model-index`` results and what was not run
        (:func:`featcal.families.causal_lm.mergebench_eval.card.card_context`)."""
        from featcal.families.causal_lm.mergebench_eval.card import card_context

        return card_context(run)


FAMILY = CausalLMFamily()
