"""The members of the seq2seq family (:data:`featcal.families.seq2seq.FAMILY`) that are not one function of its
modules as they stand: each imports what it uses when called, so that the family's facts import no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.seq2seq.evaluation import GenerationEvaluator
    from featcal.files.safetensors_writer import ShardedSafetensorsWriter
    from featcal.tasks import Task


def hidden_size(config: Any) -> int:
    """A T5's width: ``d_model``."""
    return int(config.d_model)


def save_model(state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base") -> Path:
    """A T5 folder holding ``state``, in float32 (the only ``output_dtype``)."""
    from featcal.families.seq2seq.folders import save_t5

    return save_t5(state, config, folder)


def skeleton(folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The T5 of ``folder``'s configuration, its blocks on the meta device."""
    from featcal.families.seq2seq.folders import load_config, t5_skeleton

    return t5_skeleton(load_config(folder), merged, device)


def streamed_model(
    config: Any, folder: Path, *, output_dtype: str = "base"
) -> AbstractContextManager[ShardedSafetensorsWriter]:
    """A T5 folder written tensor by tensor, in float32 (the only ``output_dtype``)."""
    from featcal.families.seq2seq.folders import streamed_t5

    return streamed_t5(config, folder)


def check_examples(
    task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
) -> Mapping[str, Any] | None:
    """Render (and with ``preprocessor`` tokenise) the pairs of ``rows``; what the run records of them."""
    from featcal.families.seq2seq.texts import check_pairs

    facts = check_pairs(task, dataset, rows, preprocessor)
    return None if facts is None else asdict(facts)


def evaluator(
    base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
) -> GenerationEvaluator:
    """The evaluation of greedy generations, holding out what ``settings`` say."""
    from featcal.families.seq2seq.evaluation import GenerationEvaluator

    return GenerationEvaluator(base_folder, device, world=world, held_out=(settings or {}).get("held_out"))


def evaluation_record() -> Mapping[str, Any]:
    """FusionBench's generation settings, fixed."""
    from featcal.families.seq2seq.evaluation import GENERATION

    return {"generation": dict(GENERATION)}
