"""The identity of each step of a run: a hash of exactly what the step's result depends on.

The stage ledger (:mod:`featcal.runfolder.ledger`) records each finished step's identity; a step whose
identity changed is redone, with every step after it (their identities include those of the steps they
read from).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcal.fingerprints import digest, folder_fingerprint
from featcal.runfolder.layout import (
    CALIBRATE_STEP,
    DIAGNOSE_STEP,
    EXPERTS_DIR,
    MERGE_STEP,
    ZERO_SHOT_DIR,
    calibrated_stage_name,
    evaluate_step,
    merged_stage_name,
)
from featcal.runfolder.recording import merges_from_data, recorded_dtype
from featcal.version import __version__

if TYPE_CHECKING:
    from featcal.data import DatasetFacts
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


def stage_identities(spec: RunSpec, inputs: RunInputs, data: DatasetFacts) -> dict[str, str]:
    """The identity of every step this run can compute, by ledger name (requested or not).

    Each identity covers exactly what the step's result depends on, and the identities of the steps
    it reads from, so a change redoes that step and everything after it.

    Args:
        spec: The run's options.
        inputs: Its resolved tasks, base and experts.
        data: What the dataset check learnt of its splits (fingerprints, calibration counts).

    Returns:
        The identity of each step, by ledger name.
    """
    merged, calibrated = merged_stage_name(spec.merge_method), calibrated_stage_name(spec.merge_method)
    base = folder_fingerprint(inputs.base_folder)
    experts = [folder_fingerprint(inputs.experts[t.name].path) for t in inputs.tasks if t.name in inputs.experts]
    tests = [data.fingerprints[t.name].get("test") for t in inputs.tasks]
    trains = [data.fingerprints[t.name].get("train") for t in inputs.tasks]
    table = {t.name: t.to_dict() for t in inputs.tasks}
    settings = inputs.family.evaluation_settings(spec, inputs.tasks)  # none for CLIP: its identities stay as they were
    evaluation = digest("evaluation", __version__, base, table, tests, spec.max_eval_samples, *filter(None, [settings]))
    ids = {evaluate_step(ZERO_SHOT_DIR): digest(evaluation), evaluate_step(EXPERTS_DIR): digest(evaluation, experts)}
    # A stored dtype other than the base's changes the written weights: part of the identities when set.
    stored = [] if recorded_dtype(spec.output_dtype) is None else ["output_dtype", spec.output_dtype]
    if not spec.skip_ta:
        # A data-using merge depends on the draw too: the train splits, how many of their examples, the seed
        # that picks them and the batch (which moves its sums by float rounding), as FeatCal's step does.
        drawn = (
            ["data", spec.featcal.num_calibration_examples, spec.featcal.calibration_batch_size, spec.seed, trains,
             data.calibration_counts]
            if merges_from_data(spec) else []
        )  # fmt: skip
        merge_id = digest(
            MERGE_STEP, __version__, spec.merge_method, inputs.merge_params, base, experts, *drawn, *stored
        )
        calibrate_from = ids[MERGE_STEP] = merge_id
        ids[evaluate_step(merged)] = digest(evaluation, merge_id)
    else:
        calibrate_from = digest("from", folder_fingerprint(spec.ta_model_path))
        ids[evaluate_step(merged)] = digest(evaluation, calibrate_from)
    # bf16 forwards change the calibrated weights and are part of the identity; tf32, which changes only
    # the rounding of CUDA matmuls, is not (a tf32 run reuses a float32 calibration, and the reverse).
    forwards = ["forwards", spec.precision] if spec.precision == "bf16" else []
    calibrate_id = digest(
        CALIBRATE_STEP, __version__, calibrate_from, spec.featcal.to_dict(), spec.seed, base, experts, trains,
        data.calibration_counts, *forwards, *stored,
    )  # fmt: skip
    ids[CALIBRATE_STEP] = calibrate_id
    ids[evaluate_step(calibrated)] = digest(evaluation, calibrate_id)
    split = "train" if spec.diagnose_split == "calibration" else "test"
    ids[DIAGNOSE_STEP] = digest(
        DIAGNOSE_STEP, __version__, calibrate_id, spec.skip_featcal, experts, spec.diagnose_split, spec.diagnose_images,
        [data.fingerprints[t.name].get(split) for t in inputs.tasks],
    )  # fmt: skip
    return ids
