"""``featcal run --repair NAME ...``: the run, then every requested repair on its merge, then its release.

The comparison is checked before the run starts (:func:`~featcal.repairs.comparison.check_comparison`);
the run's stages run as without it, the release waiting until the repairs are compared so that the
model card shows their table (:mod:`featcal.repairs.compare_table`). The released model stays the run's
own (its FeatCal calibration, or its merge): the repairs are compared, not released.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from featcal.distributed import SINGLE, World
from featcal.errors import FeatcalError
from featcal.metrics import MetricsReport
from featcal.repairs.comparison import REPAIRS_DIR, check_comparison, compare_repairs
from featcal.repairs.options import MODULE_REPAIRS
from featcal.repairs.registry import Repair
from featcal.spec import RunSpec

MERGE_RESULT = "merge.json"  # in <run>/repairs: the merge's own evaluation, the row every repair starts from


class RepairEvaluation:
    """Evaluates repaired outputs on the run's test examples, on the run's device, building the evaluator (the
    one preparation step's, :func:`featcal.prepare.prepare`) on first use.

    Args:
        spec: The run.
        merged: The merge the repairs start from (a module repair's modules apply to it).
    """

    def __init__(self, spec: RunSpec, merged: Path) -> None:
        self.spec, self.merged = spec, merged
        self._state: tuple[Any, Any, Any] | None = None

    def _ready(self) -> tuple[Any, Any, Any]:
        """The run's inputs, its evaluator (prepared for its tasks) and its test examples."""
        if self._state is None:
            from featcal.prepare import Evaluation, prepare
            from featcal.resolve import resolve_inputs

            spec = self.spec
            prepared = prepare(lambda: resolve_inputs(spec, need_experts=False), evaluation=Evaluation.of_spec(spec))
            inputs, evaluator = prepared.inputs, prepared.evaluator
            evaluator.prepare(inputs.tasks)
            data = evaluator.test_data(
                inputs.tasks, batch_size=spec.eval_batch_size, num_workers=spec.eval_num_workers,
                max_samples=spec.max_eval_samples,
            )  # fmt: skip
            self._state = (inputs, evaluator, data)
        return self._state

    def model(self, folder: Path) -> dict[str, Any]:
        """The ``metrics.json`` report of the model folder ``folder``."""
        from featcal.threads import choose_threads, torch_threads

        inputs, evaluator, data = self._ready()
        family = inputs.family
        with torch_threads(choose_threads(self.spec.threads, family.hidden_size(inputs.config))):
            model = family.load_model(folder, inputs.base)
            report = evaluator.evaluate(model, inputs.tasks, data=data, progress=False)
        return report.to_json()

    def __call__(self, repair: Repair, output: Path) -> dict[str, Any]:
        """The report of ``repair``'s output: its model's, or for a module repair the merge's with each task's
        module applied (accuracy and loss per task, and their average)."""
        if repair.name not in MODULE_REPAIRS:
            return self.model(output)
        from safetensors.torch import load_file

        from featcal.metrics import TaskMetrics
        from featcal.repairs.surgery_run import evaluate_surgery, modules_file
        from featcal.threads import choose_threads, torch_threads

        inputs, evaluator, data = self._ready()
        family = inputs.family
        modules = load_file(str(output / modules_file(repair)))
        with torch_threads(choose_threads(self.spec.threads, family.hidden_size(inputs.config))):
            model = family.load_model(self.merged, inputs.base)
            scores = evaluate_surgery(evaluator.classifier, model, modules, inputs.tasks, data, repair)
        results = {name: TaskMetrics(score["accuracy"], score["loss"]) for name, score in scores.items()}
        return MetricsReport.from_results(results).to_json()


def merged_folder(spec: RunSpec) -> Path:
    """The merge the repairs start from: the run's merged stage, or the folder a ``skip_ta`` run starts from."""
    from featcal.runfolder.layout import merged_stage_name

    return Path(spec.ta_model_path) if spec.skip_ta else Path(spec.output_dir) / merged_stage_name(spec.merge_method)


def run_compared(
    spec: RunSpec, entries: Sequence[Any], world: World = SINGLE
) -> tuple[dict[str, MetricsReport], list[dict[str, Any]]]:
    """Run ``spec``, compare the repairs ``entries`` on its merge, then release the run (unless ``no_export``).

    Args:
        spec: The run.
        entries: The repairs to compare, each alone or with its hyper-parameters (``svc``, ``svc:alpha=0.3``,
            ``{"svc": {"alpha": 0.3}}``: :mod:`featcal.repairs.entries`), in the order they are run.
        world: The processes; the comparison runs in one.

    Returns:
        The run's evaluation reports by stage folder, and the merge's result followed by each repair's.

    Raises:
        FeatcalError: under torchrun, for a comparison that could not finish (checked before the run
            starts: :func:`~featcal.repairs.comparison.check_comparison`), or a repair that fails.
    """
    from featcal.files.atomic import atomic_write_json
    from featcal.pipeline import run_pipeline
    from featcal.runfolder.layout import RELEASE_DIR
    from featcal.runfolder.lock import RunLock

    if world.distributed:
        raise FeatcalError("featcal run --repair compares the repairs in one process: start it without torchrun.")
    compared = check_comparison(spec, entries)
    results = run_pipeline(spec.replace(no_export=True), world)
    out, merged = Path(spec.output_dir), merged_folder(spec)
    evaluation = RepairEvaluation(spec, merged)
    with RunLock(out):
        rows, computed = compare_repairs(spec, compared, out, merged, evaluation, redo=spec.force)
        baseline = out / REPAIRS_DIR / MERGE_RESULT
        if computed or not baseline.is_file():
            run_id = rows[0]["run_id"]
            atomic_write_json(baseline, {"repair": "merge", "run_id": run_id, "metrics": evaluation.model(merged)})
    if not spec.no_export:
        if computed and (out / RELEASE_DIR).is_dir():
            shutil.rmtree(out / RELEASE_DIR)  # its card predates these results: exported again
        results = run_pipeline(spec.replace(force=False), world)  # every stage done above: only the release
    return results, rows
