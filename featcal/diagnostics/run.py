"""Feature drift of a run's models: the images, the measurement, and ``diagnostics.json`` with its plot.

:func:`diagnose_run` is ``featcal diagnose RUN``: it reads a finished run folder;
:func:`diagnose_models` is what the ``diagnose`` stage of ``featcal run --diagnose`` calls with the
run's models already in memory. Both write ``<run>/diagnostics.json`` and ``<run>/diagnostics.png``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
from featcal.checkpoint import StateDict
from featcal.diagnostics.drift import measure_drift
from featcal.diagnostics.plot import save_drift_plot
from featcal.diagnostics.report import CALIBRATED, DEFAULT_HEAD_POINT, DEFAULT_NOUN, MERGED, DriftReport, write_report
from featcal.distributed import SINGLE
from featcal.errors import FeatcalError, InvalidParameterError, ModelInputError
from featcal.files.model_files import MODEL_CONFIG
from featcal.runfolder.layout import DIAGNOSTICS_PLOT, calibrated_stage_name, merged_stage_name
from featcal.runfolder.reader import RunFolder, merged_model_folder
from featcal.tasks import Task

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily
    from featcal.spec import RunSpec

logger = logging.getLogger(__name__)


def drift_inputs(
    family: ModelFamily,
    tasks: Sequence[Task],
    preprocessor: Any,
    *,
    split: str,
    num_examples: int,
    seed: int,
    calibration_counts: Mapping[str, int] | None = None,
) -> Callable[[str], CalibrationBatch]:
    """``load(task)``: the examples a task's drift is measured on.

    Args:
        family: The models' family (it reads the examples).
        tasks: The run's tasks.
        preprocessor: The family's preprocessor of the base (CLIP's image processor).
        split: ``test``: the first ``num_examples`` test examples; ``calibration``: the first
            ``num_examples`` of the run's calibration examples (the train split shuffled with ``seed``),
            never more than the run calibrated on.
        num_examples: Examples per task.
        seed: The run's seed (the calibration shuffle).
        calibration_counts: The calibration examples each task used (needed for ``calibration``).
    """
    by_name = {t.name: t for t in tasks}

    def load(name: str) -> CalibrationBatch:
        task = by_name[name]
        if split == "calibration":
            count = min(num_examples, (calibration_counts or {})[name])
            return family.calibration_inputs(task, preprocessor, count, seed, world=SINGLE)
        return family.test_inputs(task, preprocessor, num_examples)

    return load


def method_label(method: str) -> str:
    """The merging method's readable name (its registry name when it is not registered)."""
    from featcal.merging import get_method

    try:
        return get_method(method).pretty_name
    except FeatcalError:
        return method


def diagnose_models(
    models: Mapping[str, nn.Module],
    experts: Mapping[str, StateDict],
    load_inputs: Callable[[str], CalibrationBatch],
    *,
    adapter: LayerAdapter,
    method: str,
    split: str,
    run_id: str,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    progress: bool = True,
    noun: str = DEFAULT_NOUN,
    head_point: str = DEFAULT_HEAD_POINT,
) -> DriftReport:
    """Measure the drift of a run's merged and/or calibrated model from its experts.

    Args:
        models: ``merged`` and/or ``calibrated`` (:data:`~featcal.diagnostics.report.MERGED`,
            :data:`~featcal.diagnostics.report.CALIBRATED`), left unchanged.
        experts: Each task's expert tensors, by task name.
        load_inputs: See :func:`drift_inputs`.
        adapter: The models' family's calibration adapter.
        method: The run's merging method (names the models and their stage folders).
        split: ``test`` or ``calibration``, as ``load_inputs`` reads.
        run_id: The run's recipe hash.
        device: Where the forward passes run.
        batch_size: Images per forward batch.
        progress: Show progress.
        noun: What the family calls one example (the report's words).
        head_point: What the family calls the last measuring point (the adapter's head).

    Returns:
        The report, not yet written.
    """
    pretty = method_label(method)
    labels = {MERGED: pretty, CALIBRATED: f"{pretty} + FeatCal"}
    stages = {MERGED: merged_stage_name(method), CALIBRATED: calibrated_stage_name(method)}
    drift = measure_drift(
        models, experts, load_inputs, adapter=adapter, device=device, batch_size=batch_size, progress=progress
    )
    return DriftReport(
        drift=drift,
        split=split,
        labels={m: labels[m] for m in models},
        stages={m: stages[m] for m in models},
        run_id=run_id,
        noun=noun,
        head_point=head_point,
    )


def write_diagnostics(run: Path, report: DriftReport) -> tuple[Path, Path | None]:
    """Write ``diagnostics.json`` and (when matplotlib is there) ``diagnostics.png`` into ``run``.

    The plot is drawn first into a hidden temporary file, so that a failure leaves the earlier files
    as they were; without matplotlib an earlier plot is removed, so the folder never holds a plot of
    other numbers.

    Returns:
        The paths of the report and of the plot (None without matplotlib).
    """
    run = Path(run)
    plot, tmp = run / DIAGNOSTICS_PLOT, run / f".{DIAGNOSTICS_PLOT}.tmp"
    try:
        has_plot = save_drift_plot(report, tmp)
        path = write_report(run, report)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if has_plot:
        os.replace(tmp, plot)
    else:
        plot.unlink(missing_ok=True)
    logger.info("Feature drift: %s", report.summary())
    return path, plot if has_plot else None


def run_model_folders(run: RunFolder) -> dict[str, Path]:
    """The merged model's folder (the stage folder, else the ``skip_ta`` source) and the calibrated one's.

    Raises:
        ModelInputError: when the run folder holds no merged model (the drift before FeatCal cannot be
            measured), or no model at all.
    """
    merged = merged_model_folder(run)
    calibrated = run.path / calibrated_stage_name(run.method)
    if merged is None:
        stage = merged_stage_name(run.method)
        has_calibrated = (calibrated / MODEL_CONFIG).is_file()
        raise ModelInputError(
            str(run.path),
            f"Run folder {run.path} holds no merged model ({stage}/ with config.json), so the drift before FeatCal "
            + ("cannot be measured beside the calibrated model's: " if has_calibrated else "cannot be measured: ")
            + "run `featcal run` on it again to restore it.",
        )
    folders = {MERGED: merged[1]}
    if (calibrated / MODEL_CONFIG).is_file():
        folders[CALIBRATED] = calibrated
    return folders


def diagnose_run(run_dir: str | Path, spec: RunSpec) -> tuple[DriftReport, Path, Path | None]:
    """Measure a finished run's feature drift and write ``diagnostics.json`` and its plot into the run folder.

    The merged model (before FeatCal) and the calibrated one (after), when the run folder holds it,
    run with each task's expert on the same examples of that task. Everything is checked (the run
    folder, the base, the experts, the datasets, the models) before the measurement starts, and
    nothing is written before it ends; the run folder is locked while it is written.

    Args:
        run_dir: The run folder written by ``featcal run``.
        spec: What to measure and where: ``diagnose_split`` (``test``: the first ``diagnose_images`` test
            examples of each task; ``calibration``: the first of the run's calibration examples),
            ``diagnose_images``, ``device``, ``precision``, ``eval_batch_size`` (examples per forward
            batch), ``cache_dir`` and ``progress``.

    Returns:
        The report, the path of ``diagnostics.json`` and that of the plot (None without matplotlib).

    Raises:
        RunFolderError: when the run folder is missing or damaged.
        InvalidParameterError: for ``calibration`` on a run that did not calibrate.
        ModelInputError: when the base, an expert or a model folder cannot be used, or the run folder
            holds no merged model.
        DatasetInputError: when a task's split cannot be loaded.
    """
    from featcal.devices import default_eval_batch_size, resolve_device
    from featcal.precision import fixed_precision
    from featcal.prepare import DatasetCheck, prepare
    from featcal.resolve import run_inputs
    from featcal.runfolder.lock import RunLock
    from featcal.runfolder.reader import read_run

    split = spec.diagnose_split
    device = resolve_device(spec.device)
    run = read_run(run_dir)
    folders = run_model_folders(run)
    record = run.record
    if split == "calibration" and record.featcal is None:
        raise InvalidParameterError(
            "diagnose_split", split, "test, since this run did not calibrate (it has no calibration images)"
        )
    counts = None
    if split == "calibration":
        n = record.featcal.params.num_calibration_examples
        counts = {t.name: int(record.calibration_examples_used.get(t.name, n)) for t in run.tasks}
    prepared = prepare(
        lambda: run_inputs(run, spec.cache_dir),
        DatasetCheck(("train",) if split == "calibration" else ("test",), with_preprocessor=False),
    )
    inputs, family, preprocessor = prepared.inputs, prepared.family, prepared.preprocessor
    models = {name: family.load_model(folder, inputs.base) for name, folder in folders.items()}
    load = drift_inputs(
        family, run.tasks, preprocessor, split=split, num_examples=spec.diagnose_images, seed=record.seed,
        calibration_counts=counts,
    )  # fmt: skip
    with RunLock(run.path), fixed_precision(spec.precision):
        report = diagnose_models(
            models, inputs.experts, load, adapter=family.adapter(), method=run.method, split=split,
            run_id=run.recipe_sha256, device=device,
            batch_size=spec.eval_batch_size or default_eval_batch_size(device), progress=spec.progress,
            noun=family.noun, head_point=family.head_point,
        )  # fmt: skip
        path, plot = write_diagnostics(run.path, report)
    return report, path, plot
