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
from featcal.checkpoint import check_finite_state
from featcal.devices import resolve_device
from featcal.distributed import SINGLE
from featcal.errors import RunFolderError
from featcal.precision import fixed_precision, forward_dtype
from featcal.prepare import DatasetCheck, Evaluation, prepare
from featcal.progress import Progress
from featcal.resolve import RunInputs, run_inputs
from featcal.runfolder.layout import CALIBRATE_STEP, merged_stage_name
from featcal.runfolder.leftovers import remove_leftovers
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import RunFolder, merged_model_folder, read_run
from featcal.runfolder.timings import evaluation_step, seconds_key
from featcal.spec import RunSpec
from featcal.sweep.plot import write_sweep
from featcal.sweep.report import SweepPoint, SweepReport
from featcal.sweep.request import DEFAULT_SIZES, SweepRequest, sweep_settings
from featcal.threads import choose_threads, torch_threads

logger = logging.getLogger(__name__)


def base_settings(run: RunFolder) -> FeatCalParams:
    """The run's FeatCal parameters (the defaults when the run skipped FeatCal)."""
    return run.record.featcal.params if run.record.featcal else FeatCalParams()


def run_sweep(run_dir: str | Path, spec: RunSpec, request: SweepRequest | None = None) -> SweepReport:
    """Calibrate the run's merged model with every setting of the sweep, evaluate each zero-shot, and
    write ``<run>/sweep/sweep.json`` and ``sweep.png``.

    The run's own FeatCal parameters, seed and evaluation (``max_eval_samples``) are kept; only n and
    the swept parameter change.

    Args:
        run_dir: A run folder written by ``featcal run`` (it must hold the merged model).
        spec: Where and how it runs: ``device``, ``precision`` (``bf16``: the calibration's forwards under
            autocast), ``eval_batch_size``, ``eval_num_workers``, ``cache_dir``, ``threads``,
            ``allow_fewer_calibration_examples`` (use every train example of a task with fewer than the
            largest n) and ``progress``; the run folder's record gives everything else.
        request: The sizes, the swept parameter and how many settings are calibrated together
            (default: n = 8 … 256, all together).

    Returns:
        The sweep's report, as written to ``sweep.json``.

    Raises:
        InvalidParameterError: for a device torch does not see, before any work.
        RunFolderError: when the run folder is incomplete, damaged, or holds no merged model.
        ModelInputError, DatasetInputError: when a model or dataset the run names cannot be used
            (e.g. a train split smaller than the largest n).
        RunLockedError: when another process is writing the run folder.
    """
    request = request or SweepRequest()
    run = read_run(run_dir)
    if not run.released.report.has_accuracy:
        raise RunFolderError(
            run.path,
            f"Run folder {run.path} evaluated a language model (held-out losses): featcal sweep charts accuracy "
            "against n, and sweeps CLIP runs only.",
        )
    base = base_settings(run)
    sizes = request.sizes or ((base.num_calibration_examples,) if request.parameter is not None else DEFAULT_SIZES)
    settings = sweep_settings(base, sizes, request.parameter)
    compute = resolve_device(spec.device)
    found: list[tuple[str, Path]] = []

    def check_merged(_inputs: RunInputs) -> None:
        merged = merged_model_folder(run)
        if merged is None:
            stage = merged_stage_name(run.method)
            raise RunFolderError(
                run.path / stage,
                f"Run folder {run.path} holds no merged model ({stage}/): run `featcal run` on it first.",
            )
        found.append(merged)

    prepared = prepare(
        lambda: run_inputs(run, spec.cache_dir),
        DatasetCheck(
            ("train", "test"), max(sizes), spec.allow_fewer_calibration_examples, run.record.seed,
            with_preprocessor=False,
        ),
        check_inputs=check_merged,
        evaluation=Evaluation(spec.device, SINGLE, lambda _inputs: run.record.evaluation.details),
    )  # fmt: skip
    inputs, family, data, evaluator = prepared.inputs, prepared.family, prepared.data, prepared.evaluator
    (merged_name, merged_folder), preprocessor = found[0], prepared.preprocessor
    merged = family.load_model(merged_folder, inputs.base)
    seed = run.record.seed
    by_name = {t.name: t for t in inputs.tasks}
    calibrate_key, evaluate_key = seconds_key(CALIBRATE_STEP), seconds_key(evaluation_step())
    timings = {calibrate_key: 0.0, evaluate_key: 0.0}
    results: dict[int, SweepPoint] = {}
    threads = choose_threads(spec.threads, family.hidden_size(inputs.config))
    together = request.together
    with RunLock(run.path), fixed_precision(spec.precision), torch_threads(threads):
        remove_leftovers(run.path)  # e.g. the temporary folder of a killed sweep
        evaluator.prepare(inputs.tasks)
        test_data = evaluator.test_data(
            inputs.tasks, batch_size=spec.eval_batch_size, num_workers=spec.eval_num_workers,
            max_samples=run.max_eval_samples,
        )  # fmt: skip
        runs = featcal_calibrate_many(
            merged, inputs.base, inputs.experts,
            lambda task: family.calibration_inputs(by_name[task], preprocessor, max(sizes), seed, world=SINGLE),
            settings, together=together, adapter=family.adapter(), device=compute, progress=spec.progress,
            forward_dtype=forward_dtype(spec.precision),
        )  # fmt: skip
        bar = Progress(desc="FeatCal sweep: settings", total=len(settings), unit="settings", enabled=spec.progress)
        with bar:
            start = time.perf_counter()
            for index, model in runs:
                timings[calibrate_key] += time.perf_counter() - start
                check_finite_state(model.state_dict(), "FeatCal")
                start = time.perf_counter()
                report = evaluator.evaluate(model, inputs.tasks, data=test_data, progress=spec.progress)
                del model
                timings[evaluate_key] += time.perf_counter() - start
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
            parameter=None if request.parameter is None else request.parameter.name,
            values=() if request.parameter is None else request.parameter.values,
            points=tuple(results[i] for i in range(len(settings))),
            merged=merged_point,
            seed=seed,
            max_eval_samples=run.max_eval_samples,
            timings={**timings, "settings_together": float(together or len(settings))},
            precision=spec.precision,
        )
        write_sweep(run.path, sweep)
    return sweep
