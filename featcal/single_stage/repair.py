"""``featcal calibrate --method NAME`` for a repair other than FeatCal, in one process: a data-free,
weight-only repair (SVC), LOT on FeatCal's calibration draw, or a module repair (Representation Surgery,
ProbSurgery) trained on it and evaluated on request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import FeatcalError
from featcal.outputs import check_output_folder
from featcal.prepare import DatasetCheck, Evaluation, Prepared, prepare
from featcal.runfolder.recording import merge_calibration
from featcal.single_stage.compute import compute_settings
from featcal.stages import merge_data

if TYPE_CHECKING:
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.families.base import ModelFamily
    from featcal.repairs.registry import Repair
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


@dataclass(frozen=True)
class RepairedFolder:
    """A repair's output folder, the tasks it read (0 for a data-free repair) and, for a module repair
    evaluated, its report (``accuracy`` by task)."""

    folder: Path
    tasks: int = 0
    report: Mapping[str, Any] | None = None


@contextmanager
def one_process(spec: RunSpec, repair: Repair) -> Iterator[World]:
    """The session of a repair that runs in one process (all but FeatCal).

    Raises:
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.distributed import session

    with session(spec.device, spec.dist_timeout) as world:
        if world.distributed:
            raise FeatcalError(
                f"featcal calibrate --method {repair.name} runs in one process: start it without torchrun."
            )
        yield world


def repair_weights(spec: RunSpec, repair: Repair, params: Mapping[str, Any], merged: str, output: str) -> Path:
    """A data-free, weight-only repair (SVC) of the merged folder ``merged`` from the base and experts it
    records (no tasks nor data), written to ``output``.

    Args:
        spec: Where to compute and write (``cache_dir``, ``device``, ``precision``, ``threads``, ``output_dtype``).
        repair: The repair.
        params: Its hyper-parameters, resolved.
        merged: The merged model folder.
        output: The model folder to write.

    Returns:
        The folder written.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used, or under torchrun with
            more than one process.
    """
    from featcal.repairs.apply import recorded_inputs, repair_state, save_repair
    from featcal.resolve import check_output_dtype

    output = check_output_folder(output, kind="repaired model", inputs=[merged])  # before any download
    with one_process(spec, repair) as world:
        inputs = recorded_inputs(merged, repair, cache_dir=spec.cache_dir)
        check_output_dtype(inputs.family, spec.output_dtype)
        check_output_folder(output, kind="repaired model", inputs=[*inputs.local_folders(), merged])
        model = inputs.family.check_model_folder(Path(merged), inputs.base)
        experts = [inputs.experts[name] for name in inputs.expert_refs]
        with compute_settings(spec, inputs):
            state = repair_state(
                repair, params, inputs.base, experts, model, device=world.compute_device(spec.device),
                output_dtype=spec.output_dtype,
            )  # fmt: skip
    return save_repair(inputs, merged, repair, params, state, output, output_dtype=spec.output_dtype)


def _prepare_draw(
    spec: RunSpec, repair: Repair, merged: str, output: Path, check_family: Callable[[ModelFamily], None], *,
    kind: str, splits: tuple[str, ...], evaluation: Evaluation | None = None,
) -> tuple[Prepared, Checkpoint]:  # fmt: skip
    """The preparation of a repair that reads FeatCal's calibration draw of the tasks: the folder must not be
    calibrated already, the repair must be defined for the tasks' family (``check_family``), then the output
    folder, the datasets and the merged folder are checked; the merged folder's checkpoint comes back too."""
    from featcal.repairs.apply import check_uncalibrated
    from featcal.resolve import resolve_inputs

    checked: list[Checkpoint] = []

    def check_inputs(inputs: RunInputs) -> None:
        check_family(inputs.family)
        check_output_folder(output, kind=kind, inputs=[*inputs.local_folders(), merged])

    def check_data(prepared: Prepared) -> None:
        checked.append(prepared.family.check_model_folder(Path(merged), prepared.inputs.base))

    check_uncalibrated(merged, repair)
    prepared = prepare(
        lambda: resolve_inputs(spec, merged=merged),
        DatasetCheck.calibration_draw(spec, splits),
        check_inputs=check_inputs,
        check_data=check_data,
        evaluation=evaluation,
    )
    return prepared, checked[0]


def _draw_record(spec: RunSpec, prepared: Prepared) -> dict[str, Any]:
    """The record of the calibration draw the repair read (:func:`~featcal.runfolder.recording.merge_calibration`)."""
    facts, tasks = prepared.data, prepared.inputs.tasks
    return merge_calibration(spec.featcal, spec.seed, facts.calibration_counts, facts.fingerprints, tasks)


def repair_lot(spec: RunSpec, repair: Repair, params: Mapping[str, Any], merged: str, output: str) -> RepairedFolder:
    """LOT of the merged folder ``merged`` on FeatCal's calibration draw of the tasks (``-n``, ``--seed``), with
    the base and the experts, written to ``output``.

    Args:
        spec: The tasks, models, the calibration draw and where to compute.
        repair: LOT.
        params: Its hyper-parameters, resolved.
        merged: The merged model folder.
        output: The model folder to write.

    Returns:
        The folder written and the number of tasks.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (a folder calibrated
            already, a family LOT is not defined for, the output folder, the datasets, the merged folder), or
            under torchrun with more than one process.
    """
    from featcal.repairs.apply import save_repair
    from featcal.repairs.lot import check_lot_family, lot_state

    out = check_output_folder(output, kind="repaired model", inputs=[merged])  # before any download
    with one_process(spec, repair) as world:
        prepared, model = _prepare_draw(spec, repair, merged, out, check_lot_family, kind="repaired model",
                                        splits=("train",))  # fmt: skip
        inputs = prepared.inputs
        draw = _draw_record(spec, prepared)
        data = merge_data(inputs, prepared.preprocessor, spec.featcal, spec.seed, world=world, progress=spec.progress)
        experts = [inputs.experts[t.name] for t in inputs.tasks]
        with compute_settings(spec, inputs):
            device = world.compute_device(spec.device)
            state = lot_state(inputs.base, experts, model, data, device, world, norms=params["norms"])
    recorded = {**params, "calibration": draw}
    folder = save_repair(inputs, merged, repair, recorded, state, out, output_dtype=spec.output_dtype)
    return RepairedFolder(folder, len(inputs.tasks))


def repair_modules(
    spec: RunSpec, repair: Repair, params: Mapping[str, Any], merged: str, output: str, *, evaluate: bool
) -> RepairedFolder:
    """Train each task's module (Representation Surgery or ProbSurgery) on FeatCal's calibration draw of the
    tasks (``-n``, ``--seed``), write the modules, recipe and report to ``output``, and with ``evaluate`` score
    them on the test splits.

    Args:
        spec: The tasks, models, the calibration draw, the evaluation's options and where to compute.
        repair: The module repair.
        params: Its hyper-parameters, resolved.
        merged: The merged model folder.
        output: The folder to write.
        evaluate: Evaluate the modules (each task's accuracy with and without them).

    Returns:
        The folder written, the number of tasks and the report (its ``accuracy`` by task with ``evaluate``).

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (a folder calibrated
            already, a family other than CLIP, the output folder, a task without a train split or, with
            ``evaluate``, a test split, the merged folder), or under torchrun with more than one process.
    """
    from featcal.repairs.surgery import check_surgery_family
    from featcal.repairs.surgery_run import evaluate_surgery, run_surgery, save_surgery

    out = check_output_folder(output, kind="repair output", inputs=[merged])  # before any download
    with one_process(spec, repair) as world:
        prepared, _ = _prepare_draw(
            spec, repair, merged, out, lambda family: check_surgery_family(family, repair), kind="repair output",
            splits=("train", "test") if evaluate else ("train",),
            evaluation=Evaluation(spec.device, world, lambda found: found.family.evaluation_settings(spec)),
        )  # fmt: skip
        inputs, family, evaluator = prepared.inputs, prepared.family, prepared.evaluator
        n, seed = spec.featcal.num_calibration_examples, spec.seed
        draw = _draw_record(spec, prepared)
        preprocessor = prepared.preprocessor
        with compute_settings(spec, inputs):
            model = family.load_model(Path(merged), inputs.base)
            batches = {t.name: family.calibration_inputs(t, preprocessor, n, seed, world=world) for t in inputs.tasks}
            pixels = {name: _only_input(batch.inputs) for name, batch in batches.items()}
            result, cost = run_surgery(
                evaluator.classifier, model, lambda name: family.build_model(inputs.config, inputs.experts[name]),
                pixels, params, seed=seed, batch_size=spec.featcal.calibration_batch_size, repair=repair,
            )  # fmt: skip
            report: dict[str, Any] = {**cost, "loss_first_step": result.losses[0], "loss_last_step": result.losses[-1]}
            if evaluate:
                evaluator.prepare(inputs.tasks)
                images = evaluator.test_data(
                    inputs.tasks, batch_size=spec.eval_batch_size, num_workers=spec.eval_num_workers,
                    max_samples=spec.max_eval_samples,
                )  # fmt: skip
                report["accuracy"] = evaluate_surgery(
                    evaluator.classifier, model, result.modules, inputs.tasks, images, repair
                )
    folder = save_surgery(inputs, merged, {**params, "calibration": draw}, result, report, out, repair)
    return RepairedFolder(folder, len(inputs.tasks), report)


def _only_input(inputs: Mapping[str, Any]) -> Any:
    """The one tensor an image family's calibration batch hands its stem (a CLIP tower's pixels)."""
    (tensor,) = inputs.values()
    return tensor
