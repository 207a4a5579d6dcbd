"""A weight-only repair of a merged model folder: its inputs from the folder's record, the tensors, the folder.

``featcal calibrate --method svc --merged DIR --output OUT`` reads the base and the experts the merge in
``DIR`` records (its ``featcal_recipe.json``, else mergekit's ``mergekit_config.yml``), repairs the merge
one tensor at a time, and writes ``OUT`` as a model folder of the merge's family whose recipe (kind
``repair``) records the merge and every repair applied to it since, so that a later ``featcal calibrate
--merged OUT`` (FeatCal) and a release read the whole chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from featcal.checkpoint import StateDict, check_finite_state
from featcal.errors import ModelInputError
from featcal.families import get_family, mergekit_family, mergekit_reader
from featcal.merging.common import is_mergeable, progress
from featcal.model_recipe import MERGEKIT_FILE, RECIPE_FILE, REPAIR, ModelRecipe, read_model_recipe, write_model_recipe
from featcal.precision import BASE_DTYPE
from featcal.repairs.registry import Repair
from featcal.resolve import RunInputs, resolve_models
from featcal.runfolder.record import MergeRecord
from featcal.stages import recorded_dtype


def recorded_inputs(merged: str | Path, repair: Repair, cache_dir: str | Path | None = None) -> RunInputs:
    """The family, base and experts the merge in ``merged`` records, resolved and checked (no tasks: a
    weight-only repair reads none); each expert named by its task where featcal's recipe names them, else by
    its reference.

    Args:
        merged: The merged model's folder.
        repair: The repair, for messages.
        cache_dir: The Hub cache folder.

    Returns:
        The inputs, their ``tasks`` empty.

    Raises:
        ModelInputError: when the folder does not exist, records neither recipe, records no base, is
            calibrated already, or a model is missing or does not fit.
    """
    folder = Path(merged)
    if not folder.is_dir():
        raise ModelInputError(str(folder), f"Merged model folder {folder} does not exist.")
    recipe = check_uncalibrated(folder, repair)
    if recipe is not None:
        family, base_ref, refs = get_family(recipe.family), recipe.base_model, dict(recipe.experts)
    else:
        mergekit = mergekit_reader().read_mergekit_folder(folder)
        if mergekit is None or not mergekit.base_model or not mergekit.models:
            raise ModelInputError(
                str(folder), f"{folder} records no base model and experts (neither a {RECIPE_FILE} nor a "
                f"{MERGEKIT_FILE} naming both): {repair.name} needs the models the merge started from.",
            )  # fmt: skip
        family, base_ref, refs = get_family(mergekit_family()), mergekit.base_model, {r: r for r in mergekit.models}
    local = Path(base_ref).expanduser()
    base_ref = str(local.resolve()) if local.exists() else base_ref
    base_folder, base, experts = resolve_models(family, list(refs), base_ref, refs, cache_dir=cache_dir)
    return RunInputs(family, [], base_ref, base_folder, refs, experts, base)


def check_uncalibrated(merged: str | Path, repair: Repair) -> ModelRecipe | None:
    """The featcal recipe of the folder ``merged`` (None without one), refused when it is calibrated already.

    Raises:
        ModelInputError: when the folder records a FeatCal calibration, or its recipe is damaged.
    """
    folder = Path(merged)
    recipe = read_model_recipe(folder)
    if recipe is not None and recipe.featcal is not None:
        raise ModelInputError(
            str(folder), f"{folder} is calibrated with FeatCal already: {repair.name} repairs a merge; apply it "
            "to the merge the calibration started from, then calibrate its output.",
        )  # fmt: skip
    return recipe


def repair_state(
    repair: Repair,
    params: Mapping[str, Any],
    base: StateDict,
    experts: list[StateDict],
    merged: StateDict,
    *,
    device: torch.device | None = None,
    output_dtype: str = BASE_DTYPE,
) -> dict[str, torch.Tensor]:
    """The repaired state dict, one tensor at a time (on the CPU).

    Each floating-point tensor is read from the base, every expert and the merge in float64 on ``device``,
    repaired by the kernel, and stored in the base's dtype (``output_dtype`` ``base``) or float32; integer
    buffers are the merge's.

    Args:
        repair: A weight-only repair (one with a kernel).
        params: Its resolved hyper-parameters.
        base: The base's tensors.
        experts: Each expert's tensors, with the base's keys.
        merged: The merge's tensors, with the base's keys.
        device: Where the kernel computes (default: the CPU).
        output_dtype: ``base`` or ``float32``.

    Returns:
        The repaired tensors by key, the merge's keys in its order.

    Raises:
        FeatcalError: when a repaired tensor is not finite although every input is.
        TypeError: for a repair without a kernel (FeatCal).
    """
    if repair.kernel is None:
        raise TypeError(f"repair {repair.name!r} has no per-tensor kernel: it is not a weight-only repair")
    state: dict[str, torch.Tensor] = {}
    for key in progress(list(merged), repair.pretty_name):
        tensor = merged[key]
        if not is_mergeable(tensor):
            state[key] = tensor.clone()
            continue
        stacked = torch.stack([expert[key].to(device, torch.float64) for expert in experts])
        result = repair.kernel(base[key].to(device, torch.float64), stacked, tensor.to(device, torch.float64), **params)
        state[key] = result.to("cpu", torch.float32 if output_dtype != BASE_DTYPE else base[key].dtype)
    check_finite_state(state, f"The {repair.name} repair")
    return state


def repair_recipe(
    inputs: RunInputs, merged_folder: str | Path, repair: Repair, params: Mapping[str, Any], output_dtype: str
) -> ModelRecipe:
    """What the repair of the merge in ``merged_folder`` records: that merge's own record (its method unknown,
    ``""``, and the text of its ``mergekit_config.yml``, when only mergekit recorded it), the repairs
    applied to it before, then this one."""
    merged = read_model_recipe(merged_folder)
    if merged is None:
        text = (Path(merged_folder) / MERGEKIT_FILE).read_text(encoding="utf-8")
        record, earlier, mergekit = MergeRecord("", {}, str(Path(merged_folder).resolve())), (), text
    else:
        record, earlier, mergekit = merged.merge, merged.repairs, merged.mergekit_config
    return ModelRecipe(
        REPAIR, inputs.family.name, inputs.base_ref, inputs.expert_refs, record, mergekit_config=mergekit,
        output_dtype=recorded_dtype(output_dtype), repairs=(*earlier, {"method": repair.name, "params": dict(params)}),
    )  # fmt: skip


def save_repair(
    inputs: RunInputs,
    merged_folder: str | Path,
    repair: Repair,
    params: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    output: str | Path,
    *,
    output_dtype: str = BASE_DTYPE,
) -> Path:
    """Write the repaired model's folder: the model (atomically, as a merge is), then its recipe
    (:func:`repair_recipe`) beside the weights."""
    folder = inputs.family.save_model(state, inputs.config, Path(output), output_dtype=output_dtype)
    write_model_recipe(folder, repair_recipe(inputs, merged_folder, repair, params, output_dtype))
    return folder
