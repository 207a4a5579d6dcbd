"""``featcal evaluate``: score a model folder (or the base) on each task and write its metrics."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.errors import OutputPathError
from featcal.files.atomic import atomic_write_json
from featcal.metrics import WEIGHTS_SHA256, MetricsReport, weights_sha256
from featcal.outputs import check_metrics_output, check_output_file
from featcal.prepare import DatasetCheck, Evaluation, prepare
from featcal.release.manifest import MANIFEST
from featcal.runfolder.layout import METRICS, RUN_CONFIG, ZERO_SHOT_DIR
from featcal.runfolder.lock import RunLock
from featcal.single_stage.compute import compute_settings

if TYPE_CHECKING:
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


@dataclass(frozen=True)
class Evaluated:
    """An evaluation's report, the name of the model it scored and the metrics file written (if any)."""

    name: str
    report: MetricsReport
    output: Path | None


def metrics_output(output: str | None, model: str | None) -> Path | None:
    """Where `featcal evaluate` writes its metrics, checked: ``output``, else the model folder's
    ``metrics.json``, which is refused where it is a run's or a release's own record.

    Raises:
        OutputPathError: for a file that cannot be written, or a run's or release's record.
    """
    if output is not None:
        return check_output_file(output, kind="metrics file")
    if model is None:
        return None
    folder = Path(model)
    if (folder / MANIFEST).is_file() or (folder.parent / RUN_CONFIG).is_file():
        owner = "a release" if (folder / MANIFEST).is_file() else f"the run {folder.parent}"
        raise OutputPathError(
            folder / METRICS,
            f"{folder / METRICS} is {owner}'s record of its evaluation: pass --output FILE to write these "
            "metrics elsewhere.",
        )
    return check_output_file(folder / METRICS, kind="metrics file")


def evaluate_model(spec: RunSpec, model: str | None, output: str | None) -> Evaluated | None:
    """Evaluate the model folder ``model`` (the base without it) on ``spec``'s tasks and write its metrics.

    Args:
        spec: The tasks, the base, the evaluation's options and where to compute.
        model: A model folder of the tasks' family, or None for the base.
        output: The metrics file (default: the model folder's ``metrics.json``; inside a run folder, only in
            its ``evaluations/``, written under the run's lock).

    Returns:
        The report, recording the SHA-256 of the model's weights, and where it was written; None in the
        processes other than rank 0.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (the metrics file, the
            tasks and base, the model's family, the test splits, the model folder), before anything is
            written.
    """
    from featcal.distributed import session
    from featcal.resolve import resolve_inputs

    written = metrics_output(output, model)
    run = None
    with session(spec.device, spec.dist_timeout) as world:
        world.compute_device(spec.device)  # a device torch does not see is refused before any input is read

        def check_inputs(inputs: RunInputs) -> None:
            nonlocal run
            if output is not None:  # the model folder's own metrics.json is checked by metrics_output
                datasets = [t.dataset.path for t in inputs.tasks]
                files = [spec.tasks_file] if spec.tasks_file else []
                run = check_metrics_output(
                    written, inputs=[*inputs.local_folders(), *files, *datasets, *([model] if model else [])]
                )

        n = spec.featcal.num_calibration_examples
        with world.main_first("checking the inputs"):
            prepared = prepare(
                lambda: resolve_inputs(spec, need_experts=False, model=model),
                DatasetCheck(("test",), held_out_after=n, with_preprocessor=False),
                check_inputs=check_inputs,
                evaluation=Evaluation.of_spec(spec, world),
            )
            inputs, evaluator = prepared.inputs, prepared.evaluator
            loaded = prepared.family.load_model(Path(model), inputs.base) if model else evaluator.base_model()
        with compute_settings(spec, inputs):
            data = evaluator.test_data(
                inputs.tasks,
                batch_size=spec.eval_batch_size,
                num_workers=spec.eval_num_workers,
                max_samples=spec.max_eval_samples,
            )
            report = evaluator.evaluate(loaded, inputs.tasks, data=data, progress=spec.progress)
    if model:  # the report is the record of these weights
        report = report.with_extra({WEIGHTS_SHA256: weights_sha256(Path(model))})
    if not world.is_main:
        return None
    if written:
        with RunLock(run) if run is not None else nullcontext():  # a run's evaluations/ under its lock
            atomic_write_json(written, report.to_json())
    return Evaluated(Path(model).name if model else ZERO_SHOT_DIR, report, written)
