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

import torch
from torch import nn

from featcal.calibration.driver import StateDict
from featcal.data import ImageProcessor, calibration_pixels, load_task_split, pixel_values
from featcal.diagnostics.drift import measure_drift
from featcal.diagnostics.plot import save_drift_plot
from featcal.diagnostics.report import CALIBRATED, MERGED, DriftReport, write_report
from featcal.errors import FeatcalError, InvalidParameterError, ModelInputError, RunFolderError
from featcal.runfolder import DIAGNOSTICS_PLOT, RUN_CONFIG, RunFolder, calibrated_stage_name, merged_stage_name
from featcal.tasks import Task

logger = logging.getLogger(__name__)

PIXEL_BATCH = 64  # images per call of the image processor


def test_pixels(task: Task, processor: ImageProcessor, n: int) -> torch.Tensor:
    """The first ``n`` images of a task's test split (all of them when it has fewer), as pixel tensors."""
    ds = load_task_split(task, "test")
    ds = ds.select(range(min(n, len(ds))))
    column = task.dataset.image_column
    chunks = [pixel_values(processor, ds[s : s + PIXEL_BATCH][column]) for s in range(0, len(ds), PIXEL_BATCH)]
    return torch.cat(chunks)


def drift_images(
    tasks: Sequence[Task],
    processor: ImageProcessor,
    *,
    split: str,
    num_images: int,
    seed: int,
    calibration_counts: Mapping[str, int] | None = None,
) -> Callable[[str], torch.Tensor]:
    """``load(task)``: the pixels of the images a task's drift is measured on.

    Args:
        tasks: The run's tasks.
        processor: The base model's image processor.
        split: ``test``: the first ``num_images`` test images; ``calibration``: the first
            ``num_images`` of the run's calibration images (the train split shuffled with ``seed``),
            never more than the run calibrated on.
        num_images: Images per task.
        seed: The run's seed (the calibration shuffle).
        calibration_counts: The calibration images each task used (needed for ``calibration``).
    """
    by_name = {t.name: t for t in tasks}

    def load(name: str) -> torch.Tensor:
        task = by_name[name]
        if split == "calibration":
            count = min(num_images, (calibration_counts or {})[name])
            return calibration_pixels(task, processor, count, seed)
        return test_pixels(task, processor, num_images)

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
    load_images: Callable[[str], torch.Tensor],
    *,
    method: str,
    split: str,
    run_id: str,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    progress: bool = True,
) -> DriftReport:
    """Measure the drift of a run's merged and/or calibrated model from its experts.

    Args:
        models: ``merged`` and/or ``calibrated`` (:data:`~featcal.diagnostics.report.MERGED`,
            :data:`~featcal.diagnostics.report.CALIBRATED`), left unchanged.
        experts: Each task's expert tensors, by task name.
        load_images: See :func:`drift_images`.
        method: The run's merging method (names the models and their stage folders).
        split: ``test`` or ``calibration``, as ``load_images`` does.
        run_id: The run's recipe hash.
        device: Where the forward passes run.
        batch_size: Images per forward batch.
        progress: Show progress.

    Returns:
        The report, not yet written.
    """
    pretty = method_label(method)
    labels = {MERGED: pretty, CALIBRATED: f"{pretty} + FeatCal"}
    stages = {MERGED: merged_stage_name(method), CALIBRATED: calibrated_stage_name(method)}
    drift = measure_drift(models, experts, load_images, device=device, batch_size=batch_size, progress=progress)
    return DriftReport(
        drift=drift,
        split=split,
        labels={m: labels[m] for m in models},
        stages={m: stages[m] for m in models},
        run_id=run_id,
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
    """The merged model's folder (the stage folder, else the ``--skip-ta`` source) and the calibrated one's.

    Raises:
        RunFolderError: (from reading the run) when it has neither.
    """
    folders: dict[str, Path] = {}
    merged = run.path / merged_stage_name(run.method)
    source = run.config["merge"].get("from")
    if (merged / "config.json").is_file():
        folders[MERGED] = merged
    elif source and (Path(source) / "config.json").is_file():
        folders[MERGED] = Path(source)
    calibrated = run.path / calibrated_stage_name(run.method)
    if (calibrated / "config.json").is_file():
        folders[CALIBRATED] = calibrated
    if not folders:
        raise ModelInputError(
            str(run.path),
            f"Run folder {run.path} holds no model folder ({merged.name}/ or {calibrated.name}/ with config.json): "
            "run `featcal run` first.",
        )
    return folders


def diagnose_run(
    run_dir: str | Path,
    *,
    split: str = "test",
    num_images: int = 256,
    device: torch.device | str = "cpu",
    batch_size: int = 64,
    progress: bool = True,
) -> tuple[DriftReport, Path, Path | None]:
    """Measure a finished run's feature drift and write ``diagnostics.json`` and its plot into the run folder.

    The merged model (before FeatCal) and the calibrated one (after), whichever the run folder holds,
    run with each task's expert on the same images of that task. Everything is checked (the run
    folder, the base, the experts, the datasets, the models) before the measurement starts, and
    nothing is written before it ends; the run folder is locked while it is written.

    Args:
        run_dir: The run folder written by ``featcal run``.
        split: ``test`` (the first ``num_images`` test images of each task) or ``calibration`` (the
            first ``num_images`` of the run's calibration images).
        num_images: Images per task.
        device: Where the forward passes run.
        batch_size: Images per forward batch.
        progress: Show progress.

    Returns:
        The report, the path of ``diagnostics.json`` and that of the plot (None without matplotlib).

    Raises:
        RunFolderError: when the run folder is missing, damaged or holds no model.
        InvalidParameterError: for ``calibration`` on a run that did not calibrate, or a bad value.
        ModelInputError: when the base, an expert or a model folder cannot be used.
        DatasetInputError: when a task's split cannot be loaded.
    """
    from featcal.checkpoint import Checkpoint, check_compatible
    from featcal.evaluation import load_image_processor
    from featcal.hub import resolve_model_folder
    from featcal.inputs import load_vision_folder, validate_datasets
    from featcal.runfolder import RunLock, read_run

    if split not in ("test", "calibration"):
        raise InvalidParameterError("diagnose_split", split, "test or calibration")
    if num_images < 1:
        raise InvalidParameterError("diagnose_images", num_images, "a whole number >= 1")
    run = read_run(run_dir)
    folders = run_model_folders(run)
    featcal = run.featcal_params
    if split == "calibration" and not featcal:
        raise InvalidParameterError(
            "diagnose_split", split, "test, since this run did not calibrate (it has no calibration images)"
        )
    counts, seed = None, run.config.get("seed")
    if split == "calibration":
        if not isinstance(seed, int):
            raise RunFolderError(
                run.path, f"{run.path / RUN_CONFIG} records no seed, so its calibration images are unknown."
            )
        used = featcal.get("calibration_examples_used") or {}
        counts = {t.name: int(used.get(t.name, featcal["num_calibration_examples"])) for t in run.tasks}
    base_folder = resolve_model_folder(run.base_model, what="base model")
    base = Checkpoint(base_folder, name=f"base model {run.base_model}")
    experts: dict[str, Checkpoint] = {}
    for task in run.tasks:
        ref = run.experts.get(task.name)
        if not ref:
            raise ModelInputError(None, f"{run.path / RUN_CONFIG} names no expert for task {task.name!r}.")
        folder = resolve_model_folder(ref, what=f"expert for task {task.name!r}")
        experts[task.name] = Checkpoint(folder, name=f"Expert for task {task.name!r} ({ref})")
    check_compatible(base, experts)
    validate_datasets(list(run.tasks), ("train",) if split == "calibration" else ("test",))
    processor = load_image_processor(base_folder)
    models = {name: load_vision_folder(folder, base) for name, folder in folders.items()}
    load = drift_images(
        run.tasks, processor, split=split, num_images=num_images, seed=seed or 0, calibration_counts=counts
    )
    with RunLock(run.path):
        report = diagnose_models(
            models, experts, load, method=run.method, split=split, run_id=run.recipe_sha256,
            device=device, batch_size=batch_size, progress=progress,
        )  # fmt: skip
        path, plot = write_diagnostics(run.path, report)
    return report, path, plot
