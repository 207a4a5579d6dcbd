"""The members of the causal-LM family (:data:`featcal.families.causal_lm.FAMILY`) that are not one function
of its modules as they stand: each imports what it uses when called, so that the family's facts import no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.causal_lm.evaluation import HeldOutEvaluator
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec
    from featcal.tasks import Task


def skeleton(folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The model of ``folder``'s configuration, its layers on the meta device (``ModelFamily.skeleton``)."""
    from featcal.families.causal_lm.folders import lm_skeleton, load_config

    return lm_skeleton(load_config(folder), merged, device)


def load_split(task: Task, split: str) -> Any:
    """The task's calibration split, for ``train`` and ``test`` alike: its evaluation reads rows held out of it
    (:mod:`featcal.families.causal_lm.evaluation`)."""
    from featcal.families.causal_lm.texts import load_text_split

    return load_text_split(task)


def check_examples(
    task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
) -> Mapping[str, Any] | None:
    """Render (and with ``preprocessor`` tokenise) the rows; what the run records of them."""
    from featcal.families.causal_lm.texts import check_texts

    facts = check_texts(task, dataset, rows, preprocessor)
    return None if facts is None else asdict(facts)


def evaluator(
    base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
) -> HeldOutEvaluator:
    """The held-out evaluator of the run (:class:`~featcal.families.causal_lm.evaluation.HeldOutEvaluator`).

    Raises:
        TypeError: without ``settings`` (:func:`evaluation_settings`'s).
    """
    from featcal.families.causal_lm.evaluation import HeldOutEvaluator

    if settings is None:
        raise TypeError("a language model's evaluator needs its settings (evaluation_settings)")
    return HeldOutEvaluator(base_folder, device, world=world, settings=settings)


def evaluation_settings(spec: RunSpec, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
    """The held-out rows' shuffle, the greedy answers' length and the harness's tasks
    (:class:`~featcal.families.causal_lm.settings.LMEvaluationSettings`)."""
    from featcal.families.causal_lm import settings

    return settings.evaluation_settings(spec).to_json()


def card_context(run: RunFolder) -> Mapping[str, Any]:
    """The run card's results section (:func:`~featcal.families.causal_lm.run_card.run_context`) and MergeBench's
    scores when the protocol ran (:func:`~featcal.families.causal_lm.mergebench_eval.card.card_context`)."""
    from featcal.families.causal_lm.mergebench_eval.card import card_context as protocol_context
    from featcal.families.causal_lm.run_card import run_context

    return {**run_context(run), **protocol_context(run)}
