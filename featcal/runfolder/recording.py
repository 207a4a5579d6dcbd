"""What a run and its model folders record of their inputs: the run record built from a spec and its
resolved inputs (``run_config.json``, :class:`~featcal.runfolder.record.RunRecord`), the merge's section,
and the calibration draw a data-using merge read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from featcal.errors import InvalidParameterError
from featcal.merging import get_method
from featcal.metrics import CALIBRATION_EXAMPLES_USED
from featcal.model_recipe import read_model_recipe
from featcal.precision import BASE_DTYPE
from featcal.runfolder.record import EvaluationRecord, FeatCalRecord, MergeRecord, RunRecord
from featcal.suites import DEFAULT_BACKBONE, DEFAULT_SUITE
from featcal.version import __version__

if TYPE_CHECKING:
    from featcal.calibration.params import FeatCalParams
    from featcal.data import DatasetFacts
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec
    from featcal.tasks import Task


def recorded_dtype(output_dtype: str) -> str | None:
    """What a recipe records of ``--output-dtype``: None (nothing) for ``base``, so that a folder written
    without the option records what it did before the option existed."""
    return None if output_dtype == BASE_DTYPE else output_dtype


def merges_from_data(spec: RunSpec) -> bool:
    """Whether the run's merge step reads the tasks' calibration data (a data-using method, not skip_ta)."""
    return not spec.skip_ta and get_method(spec.merge_method).uses_data


def merge_calibration(
    params: FeatCalParams,
    seed: int,
    counts: Mapping[str, int],
    fingerprints: Mapping[str, Mapping[str, str]] | None = None,
    tasks: Sequence[Task] = (),
) -> dict[str, Any]:
    """The record of the calibration draw a data-using merge read (:attr:`MergeRecord.calibration`).

    Args:
        params: Its ``num_calibration_examples`` and ``calibration_batch_size``.
        seed: The seed of the shuffle that picked each task's examples.
        counts: The examples used by each task whose train split holds fewer than asked for.
        fingerprints: Each task's splits' identities (:class:`~featcal.data.DatasetFacts`); with them (a
            merged folder's recipe) each task's train split is recorded too.
        tasks: The tasks, for the dataset each split is of.

    Returns:
        ``num_calibration_examples``, ``calibration_batch_size``, ``seed``; ``calibration_examples_used``
        when some task had fewer; ``datasets`` (dataset, split, fingerprint by task) with ``fingerprints``.
    """
    record: dict[str, Any] = {
        "num_calibration_examples": params.num_calibration_examples,
        "calibration_batch_size": params.calibration_batch_size,
        "seed": seed,
    }
    if counts:
        record[CALIBRATION_EXAMPLES_USED] = dict(counts)
    if fingerprints is not None:
        record["datasets"] = {
            t.name: {
                "dataset": t.dataset.path,
                "split": t.dataset.calibration_split(),
                "fingerprint": fingerprints[t.name]["train"],
            }
            for t in tasks
        }
    return record


def run_record(spec: RunSpec, inputs: RunInputs, data: DatasetFacts | None = None) -> RunRecord:
    """What ``run_config.json`` records: the spec's reproducible part, with tasks and models resolved.

    Its hash is the run's id (``run_id``, and ``recipe_sha256`` in the released weights). When some
    task's train split holds fewer examples than ``num_calibration_examples`` (and that was allowed),
    the FeatCal section records the number each such task used. The commit every Hub model and
    dataset was read at is recorded too, so the run can be repeated on the same inputs.

    Raises:
        InvalidParameterError: as :func:`merge_record`.
    """
    calibration_counts = data.calibration_counts if data is not None else {}
    commits = {"models": inputs.model_commits(), "datasets": dict(data.commits) if data is not None else {}}
    # The FeatCal section records the examples each task used; so does a data-using merge's section.
    return RunRecord(
        featcal_version=__version__,
        base_model_id=inputs.base_ref,
        experts=inputs.expert_refs,
        tasks=tuple(t.name for t in inputs.tasks),
        tasks_table={t.name: t.to_dict() for t in inputs.tasks},
        seed=spec.seed,
        merge=merge_record(spec, inputs, calibration_counts),
        featcal=None if spec.skip_featcal else FeatCalRecord(spec.featcal, dict(calibration_counts or {})),
        evaluation=EvaluationRecord(
            spec.max_eval_samples,
            {**inputs.family.evaluation_record(), **inputs.family.evaluation_settings(spec, inputs.tasks)},
        ),
        precision=spec.precision,
        family=inputs.family.name,
        hub_commits={kind: refs for kind, refs in commits.items() if refs},
        output_dtype=recorded_dtype(spec.output_dtype),
        **suite_record(spec),
    )


def merge_record(spec: RunSpec, inputs: RunInputs, counts: Mapping[str, int] | None = None) -> MergeRecord:
    """The run's merge: its method and hyper-parameters, and for a data-using method the calibration draw
    (FeatCal's: ``num_calibration_examples``, batch and seed; ``counts``, the examples of the tasks that had
    fewer); with ``skip_ta``, the folder it starts from and what that folder's own recipe says of its merge
    (nothing, when it records none).

    Raises:
        InvalidParameterError: with ``skip_ta``, for a folder whose merge was repaired (SVC), which a run's
            record and card do not describe yet.
    """
    if not spec.skip_ta:
        calibration = merge_calibration(spec.featcal, spec.seed, counts or {}) if merges_from_data(spec) else None
        return MergeRecord(spec.merge_method, inputs.merge_params, calibration=calibration)
    recipe = read_model_recipe(spec.ta_model_path)
    if recipe is not None and recipe.repairs:
        raise InvalidParameterError(
            "ta_model_path", spec.ta_model_path, "a merged folder without repairs: this one's merge was repaired "
            f"({', '.join(r['method'] for r in recipe.repairs)}), which a run does not record yet; calibrate it with "
            "`featcal calibrate --merged DIR` instead (docs/repairs.md)",
        )  # fmt: skip
    described = None if recipe is None else {"method": recipe.merge.method, "params": dict(recipe.merge.params)}
    return MergeRecord(spec.merge_method, {}, spec.ta_model_path, described)


def suite_record(spec: RunSpec) -> dict[str, str]:
    """The suite and backbone chosen, when not the defaults (``ta8``, ``b32``).

    The tasks, models and references they select are recorded in full anyway; leaving the defaults
    out keeps the record, and so the run id, of a run on the defaults free of them.
    """
    chosen = {"suite": (spec.suite, DEFAULT_SUITE), "backbone": (spec.backbone, DEFAULT_BACKBONE)}
    return {key: value for key, (value, default) in chosen.items() if value != default}
