"""The work of a run's model stages, family-agnostic: merge the experts, calibrate the merge.

``featcal run`` (:mod:`featcal.pipeline`) and the single-stage commands ``featcal merge`` and
``featcal calibrate`` call these with resolved inputs (:mod:`featcal.resolve`); the model family
supplies everything model-specific.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from featcal.calibration.params import FeatCalParams
from featcal.calibration.stream_storage import AUTO
from featcal.calibration.streaming import featcal_calibrate_folder
from featcal.checkpoint import check_finite_state
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError
from featcal.families import IMAGE_SCHEMA, task_schema
from featcal.merging import get_method
from featcal.merging.data import MergeData
from featcal.model_recipe import (
    CALIBRATION,
    MERGE,
    MERGEKIT_FILE,
    REPAIR,
    ModelRecipe,
    calibration_entry,
    read_model_recipe,
    write_model_recipe,
)
from featcal.precision import BASE_DTYPE, forward_dtype
from featcal.runfolder.record import FeatCalRecord, MergeRecord
from featcal.runfolder.recording import recorded_dtype

if TYPE_CHECKING:
    from featcal.resolve import RunInputs
    from featcal.tasks import Task


def merge_recipe(
    inputs: RunInputs, method: str, calibration: Mapping[str, Any] | None = None, output_dtype: str = BASE_DTYPE
) -> ModelRecipe:
    """What a merge of ``inputs`` by ``method``, written in ``output_dtype``, records beside its weights
    (``calibration``: the data a data-using method merged from,
    :func:`~featcal.runfolder.recording.merge_calibration`)."""
    record = MergeRecord(method, inputs.merge_params, calibration=calibration)
    return ModelRecipe(
        MERGE, inputs.family.name, inputs.base_ref, inputs.expert_refs, record,
        output_dtype=recorded_dtype(output_dtype),
    )  # fmt: skip


def merge_data(
    inputs: RunInputs, preprocessor: Any, params: FeatCalParams, seed: int, *, world: World = SINGLE,
    progress: bool = True,
) -> MergeData:  # fmt: skip
    """What a data-using merge of ``inputs`` reads: the family's adapter and the base's skeleton, and each
    task's calibration examples drawn as FeatCal draws them (the first ``num_calibration_examples`` after
    the shuffle with ``seed``; this process's part under torchrun)."""
    family, by_name = inputs.family, {t.name: t for t in inputs.tasks}
    return MergeData(
        adapter=family.adapter(),
        skeleton=lambda device: family.skeleton(inputs.base_folder, inputs.base, device),
        tasks=tuple(by_name),
        load_inputs=lambda name: family.calibration_inputs(
            by_name[name], preprocessor, params.num_calibration_examples, seed, world=world
        ),
        batch_size=params.calibration_batch_size,
        progress=progress,
    )


def calibration_recipe(
    inputs: RunInputs,
    merged_folder: str | Path,
    params: FeatCalParams,
    seed: int,
    counts: Mapping[str, int],
    output_dtype: str = BASE_DTYPE,
) -> ModelRecipe:
    """What the calibration of the merge in ``merged_folder`` records beside its weights: the merge's own
    recipe when that folder records one (its method unknown, ``""``, when not, and then the text of its
    ``mergekit_config.yml`` when mergekit made it), the repairs applied to that merge (``featcal calibrate
    --method svc``'s output calibrated: its repairs, and the mergekit text it carries), each text task's
    calibration data, and ``output_dtype`` unless it is ``base``."""
    merged = read_model_recipe(merged_folder)
    merge_record = MergeRecord("", {}, str(Path(merged_folder).resolve())) if merged is None else merged.merge
    mergekit = Path(merged_folder) / MERGEKIT_FILE
    data = {
        t.name: calibration_entry(
            t, inputs.expert_refs.get(t.name), counts.get(t.name, params.num_calibration_examples)
        )
        for t in inputs.tasks
        if t.text is not None and task_schema(t.family) != IMAGE_SCHEMA  # an image task's classes are no data
    }
    return ModelRecipe(
        CALIBRATION, inputs.family.name, inputs.base_ref, inputs.expert_refs, merge_record,
        FeatCalRecord(params, dict(counts)), seed, calibration_data=data,
        mergekit_config=mergekit.read_text(encoding="utf-8") if merged is None and mergekit.is_file() else
        merged.mergekit_config if merged is not None and merged.kind == REPAIR else None,
        output_dtype=recorded_dtype(output_dtype), repairs=() if merged is None else merged.repairs,
    )  # fmt: skip


def merge(
    inputs: RunInputs,
    method: str,
    device: torch.device | None = None,
    *,
    world: World = SINGLE,
    data: MergeData | None = None,
    output_dtype: str = BASE_DTYPE,
) -> dict[str, torch.Tensor]:
    """The merged model's state dict (on the CPU), computed on ``device`` (shared by ``world``'s processes);
    ``data``: the calibration data of a method that uses it (:func:`merge_data`).

    Args:
        inputs: The run's family, tasks, base and experts.
        method: The merging method's name.
        device: Where the merge computes.
        world: The processes that share the merge.
        output_dtype: ``base``: the merged tensors in the base's dtypes; ``float32``: in float32, the
            arithmetic's values unrounded (for a folder written in float32).

    Returns:
        The merged tensors by state-dict key.

    Raises:
        FeatcalError: when the merge gives a non-finite tensor from finite inputs.
    """
    experts = [inputs.experts[t.name] for t in inputs.tasks]
    dtype = None if output_dtype == BASE_DTYPE else getattr(torch, output_dtype)
    merged = get_method(method)(
        inputs.base, experts, device=device, world=world, data=data, dtype=dtype, **inputs.merge_params
    )
    check_finite_state(merged, f"The {method} merge")
    return merged


def save_merge(
    inputs: RunInputs,
    method: str,
    state: Mapping[str, torch.Tensor],
    folder: str | Path,
    calibration: Mapping[str, Any] | None = None,
    *,
    output_dtype: str = BASE_DTYPE,
) -> Path:
    """Write a merge's folder: the model (atomically, its weights stored in ``output_dtype``, one of the
    family's ``output_dtypes``), then its recipe beside the weights (``calibration``: the data a
    data-using method merged from, :func:`~featcal.runfolder.recording.merge_calibration`)."""
    folder = inputs.family.save_model(state, inputs.config, Path(folder), output_dtype=output_dtype)
    write_model_recipe(folder, merge_recipe(inputs, method, calibration, output_dtype))
    return folder


def calibrate(
    inputs: RunInputs,
    merged_folder: str | Path,
    output: str | Path | None,
    params: FeatCalParams,
    *,
    seed: int,
    device: torch.device,
    preprocessor: Any,
    progress: bool = True,
    world: World = SINGLE,
    precision: str = "float32",
    counts: Mapping[str, int] | None = None,
    output_dtype: str = BASE_DTYPE,
    stream_storage: str = AUTO,
) -> None:
    """FeatCal of the merged model in ``merged_folder`` (checked by the caller), written to ``output``
    one layer at a time: the model is never whole in memory, and the folder appears only when the
    calibration ends, its recipe written beside the weights then.

    Args:
        inputs: The run's family, tasks, base and experts.
        merged_folder: The merged model's folder.
        output: The calibrated model's folder; None on the processes of a torchrun other than rank 0,
            which compute the same weights without writing them.
        params: FeatCal's hyper-parameters.
        seed: The seed of the shuffle that picks each task's calibration examples.
        device: Where the calibration computes.
        preprocessor: The family's preprocessor of the base (:meth:`~featcal.families.base.ModelFamily.preprocessor`).
        progress: Show progress bars.
        world: Under torchrun, each process reads its part of every task's calibration examples.
        precision: ``bf16`` runs the layer forwards under bfloat16 autocast.
        counts: The calibration examples of each task that had fewer than asked for (for the recipe).
        output_dtype: The dtype the weights are stored in (one of the family's ``output_dtypes``).
        stream_storage: Where each task's feature streams live between their uses
            (:mod:`featcal.calibration.stream_storage`).
    """
    by_name = {t.name: t for t in inputs.tasks}
    family = inputs.family
    featcal_calibrate_folder(
        family,
        merged_folder,
        output,
        inputs.base,
        inputs.experts,
        lambda name: family.calibration_inputs(
            by_name[name], preprocessor, params.num_calibration_examples, seed, world=world
        ),
        params,
        config=inputs.config,
        device=device,
        progress=progress,
        world=world,
        forward_dtype=forward_dtype(precision),
        output_dtype=output_dtype,
        stream_storage=stream_storage,
    )
    if output is not None:
        recipe = calibration_recipe(inputs, merged_folder, params, seed, counts or {}, output_dtype)
        write_model_recipe(Path(output), recipe)


def check_calibration_shares(
    tasks: Sequence[Task], counts: Mapping[str, int], requested: int, world: World, noun: str = "example"
) -> None:
    """Refuse, before anything is written, a task with fewer calibration examples than processes.

    Args:
        tasks: The run's tasks.
        counts: Examples used by each task whose train split is smaller than ``requested``.
        requested: ``num_calibration_examples``.
        world: The processes, each of which takes a part of every task's examples.
        noun: What the family calls one example (``image``).

    Raises:
        DatasetInputError: naming the task and the largest number of processes it allows.
    """
    for task in tasks:
        count = counts.get(task.name, requested)
        if count < world.size:
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: its {count} calibration {noun}(s) cannot be split over {world.size} "
                f"processes; start at most {count} processes, or raise `num_calibration_examples`.",
            )
