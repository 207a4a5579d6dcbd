"""`featcal sweep`: FeatCal of a run's merged model for several calibration sizes (and values of one
parameter), each setting evaluated zero-shot, the curve written into the run folder.

The settings are calibrated together (:mod:`featcal.calibration.sweep`): the calibration images are
loaded once for the largest n, each expert layer is loaded and run once per task and layer for all
settings, and the class heads and the test-image loader serve every evaluation.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from featcal.calibration.params import FeatCalParams
from featcal.calibration.sweep import featcal_calibrate_many
from featcal.checkpoint import Checkpoint, check_compatible
from featcal.data import calibration_pixels
from featcal.devices import resolve_device
from featcal.errors import InvalidParameterError, RunFolderError
from featcal.evaluation import ZeroShotClassifier, check_clip_model_folder, load_base_clip
from featcal.hub import resolve_model_folder
from featcal.inputs import RunInputs, load_vision_folder, validate_datasets
from featcal.pipeline import check_finite
from featcal.precision import PRECISIONS, fixed_precision, forward_dtype
from featcal.progress import Progress
from featcal.runfolder import RUN_CONFIG, RunFolder, RunLock, merged_stage_name, read_run, remove_leftovers
from featcal.sweep.plot import write_sweep
from featcal.sweep.report import SweepPoint, SweepReport
from featcal.sweep.request import DEFAULT_SIZES, SweptParameter, sweep_settings
from featcal.threads import choose_threads, torch_threads

logger = logging.getLogger(__name__)


def run_inputs(run: RunFolder, cache_dir: str | None = None) -> RunInputs:
    """The base, the experts and the tasks a run folder's ``run_config.json`` names, resolved and checked.

    Raises:
        RunFolderError: when the run names no experts.
        ModelInputError: when a model is missing, not finite, or of another architecture than the base.
    """
    base_ref = run.base_model
    base_folder = resolve_model_folder(base_ref, what="base model", cache_dir=cache_dir)
    check_clip_model_folder(base_folder)
    base = Checkpoint(base_folder, name=f"base model {base_ref}")
    base.check_finite()
    refs = dict(run.experts)
    missing = [t.name for t in run.tasks if t.name not in refs]
    if missing:
        raise RunFolderError(
            run.path / RUN_CONFIG,
            f"{run.path / RUN_CONFIG} names no expert for task(s) {missing}: a sweep needs every task's expert.",
        )
    experts = {
        t.name: Checkpoint(
            resolve_model_folder(refs[t.name], what=f"expert for task {t.name!r}", cache_dir=cache_dir),
            name=f"Expert for task {t.name!r} ({refs[t.name]})",
        )
        for t in run.tasks
    }
    check_compatible(base, experts)
    for expert in experts.values():
        expert.check_finite()
    return RunInputs(list(run.tasks), base_ref, base_folder, refs, experts, base, dict(run.merge_params))


def merged_model_folder(run: RunFolder) -> tuple[str, Path]:
    """The run's merged model: its stage folder, else the folder it was taken from (``--skip-ta``).

    Raises:
        RunFolderError: when the run folder holds no merged model and names none.
    """
    name = merged_stage_name(run.method)
    folder = run.path / name
    if (folder / "config.json").is_file():
        return name, folder
    source = run.config["merge"].get("from")
    if source and (Path(source) / "config.json").is_file():
        return Path(source).name, Path(source)
    raise RunFolderError(
        folder, f"Run folder {run.path} holds no merged model ({name}/): run `featcal run` on it first."
    )


def base_settings(run: RunFolder) -> FeatCalParams:
    """The run's FeatCal parameters (the defaults when the run skipped FeatCal)."""
    recorded = dict(run.featcal_params or {})
    known = set(FeatCalParams.__dataclass_fields__)
    return FeatCalParams(**{k: v for k, v in recorded.items() if k in known})


def run_sweep(
    run_dir: str | Path,
    *,
    sizes: tuple[int, ...] | None = None,
    parameter: SweptParameter | None = None,
    device: str = "auto",
    precision: str = "float32",
    eval_batch_size: int | None = None,
    eval_num_workers: int = 0,
    cache_dir: str | None = None,
    threads: int | None = None,
    together: int | None = None,
    allow_fewer_calibration_examples: bool = False,
    progress: bool = True,
) -> SweepReport:
    """Calibrate the run's merged model with every setting of the sweep, evaluate each zero-shot, and
    write ``<run>/sweep/sweep.json`` and ``sweep.png``.

    The run's own FeatCal parameters, seed and evaluation (``max_eval_samples``) are kept; only n and
    the swept parameter change.

    Args:
        run_dir: A run folder written by ``featcal run`` (it must hold the merged model).
        sizes: Calibration images per task (default: 8 … 256; with ``parameter``, the run's n).
        parameter: The FeatCal parameter to sweep and its values (:func:`~featcal.sweep.request.parse_parameter`).
        device: auto, cpu, cuda or cuda:N.
        precision: ``float32``, ``tf32`` (CUDA matmuls) or ``bf16`` (the calibration's forwards under autocast).
        eval_batch_size: Test images per batch (default: the device's, see
            :func:`featcal.evaluation.default_eval_batch_size`).
        eval_num_workers: Data-loading workers for the test images.
        cache_dir: The Hub cache folder, for models and datasets named by Hub id.
        threads: torch CPU threads (default: 1 for vision towers narrower than 256, else torch's).
        together: At most this many settings are calibrated at once (each holds a model, its student
            streams and its layer statistics in memory); None: all of them.
        allow_fewer_calibration_examples: Use every train image of a task with fewer than the largest n.
        progress: Show progress bars.

    Returns:
        The sweep's report, as written to ``sweep.json``.

    Raises:
        InvalidParameterError: for a bad ``together``, device or precision, before any work.
        RunFolderError: when the run folder is incomplete, damaged, or holds no merged model.
        ModelInputError, DatasetInputError: when a model or dataset the run names cannot be used
            (e.g. a train split smaller than the largest n).
        RunLockedError: when another process is writing the run folder.
    """
    if together is not None and together < 1:
        raise InvalidParameterError("together", together, "a whole number >= 1")
    if precision not in PRECISIONS:
        raise InvalidParameterError("precision", precision, "one of " + ", ".join(PRECISIONS))
    run = read_run(run_dir)
    base = base_settings(run)
    sizes = sizes or ((base.num_calibration_examples,) if parameter is not None else DEFAULT_SIZES)
    settings = sweep_settings(base, sizes, parameter)
    compute = resolve_device(device)
    inputs = run_inputs(run, cache_dir)
    merged_name, merged_folder = merged_model_folder(run)
    data = validate_datasets(
        inputs.tasks,
        ("train", "test"),
        calibration_examples=max(sizes),
        allow_fewer=allow_fewer_calibration_examples,
    )
    clip, tokenizer, processor = load_base_clip(inputs.base_folder, compute)
    merged = load_vision_folder(merged_folder, inputs.base)
    seed = int(run.config.get("seed", 42))
    by_name = {t.name: t for t in inputs.tasks}
    timings = {"calibrate_s": 0.0, "evaluate_s": 0.0}
    results: dict[int, SweepPoint] = {}
    threads = choose_threads(threads, inputs.vision_config.hidden_size)
    with RunLock(run.path), fixed_precision(precision), torch_threads(threads):
        remove_leftovers(run.path)  # e.g. the temporary folder of a killed sweep
        classifier = ZeroShotClassifier(clip, tokenizer, compute)
        images = classifier.test_images(
            inputs.tasks, processor, batch_size=eval_batch_size, num_workers=eval_num_workers,
            max_samples=run.max_eval_samples,
        )  # fmt: skip
        runs = featcal_calibrate_many(
            merged, inputs.base, inputs.experts,
            lambda task: calibration_pixels(by_name[task], processor, max(sizes), seed),
            settings, together=together, device=compute, progress=progress, forward_dtype=forward_dtype(precision),
        )  # fmt: skip
        with Progress(desc="FeatCal sweep: settings", total=len(settings), unit="settings", enabled=progress) as bar:
            start = time.perf_counter()
            for index, model in runs:
                timings["calibrate_s"] += time.perf_counter() - start
                check_finite(model.state_dict(), "FeatCal")
                start = time.perf_counter()
                report = classifier.evaluate(model, inputs.tasks, progress=progress, images=images)
                del model
                timings["evaluate_s"] += time.perf_counter() - start
                n = settings[index].num_calibration_examples
                results[index] = SweepPoint(
                    params=settings[index].to_dict(),
                    average=report.accuracy("average"),
                    tasks={name: metrics.accuracy for name, metrics in report.tasks.items()},
                    calibration_examples_used={t: c for t, c in data.calibration_counts.items() if c < n},
                )
                changed = {k: v for k, v in results[index].params.items() if k != "calibration_batch_size"}
                logger.info("FeatCal sweep: %s: average accuracy %.4f", changed, results[index].average)
                bar.update()
                if compute.type == "cuda":
                    torch.cuda.empty_cache()
                start = time.perf_counter()
        merged_point = None
        if run.merged is not None:
            merged_report = run.merged.report
            merged_point = SweepPoint(
                params={"num_calibration_examples": 0},
                average=merged_report.accuracy("average"),
                tasks={t.name: merged_report.accuracy(t.name) for t in inputs.tasks},
            )
        sweep = SweepReport(
            run_id=run.recipe_sha256,
            merged_model=merged_name,
            sizes=tuple(sizes),
            parameter=None if parameter is None else parameter.name,
            values=() if parameter is None else parameter.values,
            points=tuple(results[i] for i in range(len(settings))),
            merged=merged_point,
            seed=seed,
            max_eval_samples=run.max_eval_samples,
            timings={**timings, "settings_together": float(together or len(settings))},
            precision=precision,
        )
        write_sweep(run.path, sweep)
    return sweep
