"""The stages of a run, over a :class:`~featcal.spec.RunSpec` and a run folder, for any model family.

merge → evaluate → calibrate → evaluate (→ diagnose) → export: a table of steps
(:class:`~featcal.steps.Step`) that one executor walks, each writing through :mod:`featcal.runfolder`
into the reference run's layout and skipped when the folder already holds its result from the same
inputs. Inputs are checked (:mod:`featcal.run_checks`, through :mod:`featcal.prepare`) before the first
file is written; the run record, the steps' identities and the clean-up of stale outputs are
:mod:`featcal.runfolder`'s (``recording``, ``identities``, ``cleanup``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from featcal.devices import default_eval_batch_size
from featcal.diagnostics.report import CALIBRATED, MERGED
from featcal.distributed import SINGLE, World
from featcal.files.faults import fault_point
from featcal.files.reading import read_json
from featcal.memory import MemoryMeter, release_free_memory
from featcal.metrics import WEIGHTS_SHA256, MetricsReport, weights_sha256
from featcal.precision import fixed_precision
from featcal.prepare import Prepared
from featcal.run_checks import prepare_run
from featcal.runfolder.cleanup import clear_stale, export_identity
from featcal.runfolder.identities import stage_identities
from featcal.runfolder.layout import (
    CALIBRATE_STEP,
    DIAGNOSE_STEP,
    DIAGNOSTICS,
    DIAGNOSTICS_PLOT,
    EXPERTS_DIR,
    EXPORT_STEP,
    MERGE_STEP,
    METRICS,
    RELEASE_DIR,
    RUN_LOG,
    STAGES_FILE,
    TIMINGS,
    ZERO_SHOT_DIR,
    calibrated_stage_name,
    evaluate_step,
    merged_stage_name,
)
from featcal.runfolder.ledger import StageLedger
from featcal.runfolder.leftovers import remove_leftovers
from featcal.runfolder.lock import RunLock
from featcal.runfolder.record import RunRecord, write_run_config
from featcal.runfolder.recording import merge_calibration, merges_from_data
from featcal.runfolder.reports import stage_report, write_stage_report
from featcal.runfolder.timings import evaluation_step, write_timings
from featcal.spec import RunSpec
from featcal.stages import calibrate, merge, merge_data, save_merge
from featcal.steps import Step, StepExecutor
from featcal.threads import torch_threads

logger = logging.getLogger(__name__)


def run_pipeline(spec: RunSpec, world: World = SINGLE) -> dict[str, MetricsReport]:
    """Run every stage ``spec`` asks for, writing the run folder ``spec.output_dir``.

    Everything is validated first: options, models, datasets, the output folder. Then the folder is
    locked, leftovers of a killed run are removed, and each stage runs unless the folder already
    holds its result from the same inputs (``stages.json`` records them); a stage whose inputs
    changed is redone with everything after it. ``spec.force`` redoes every stage.

    Under torchrun (``world``) every process runs the stages together; rank 0 alone checks the
    inputs first (downloads, dataset caches), then the others; rank 0 alone writes the folder.

    Args:
        spec: The run's options (see :class:`~featcal.spec.RunSpec`).
        world: The processes (:func:`featcal.distributed.session`); one by default.

    Returns:
        The evaluation report of each evaluated stage, by stage folder name (``zero-shot``,
        ``experts``, ``ta``, ``featcal-ta``, …).

    Raises:
        FeatcalError: for any input that cannot be used (typed subclasses name it), raised before
            any file is written whenever the problem can be seen up front; ``RunLockedError`` when
            another process is writing the folder.
    """
    device = world.compute_device(spec.device)
    out = Path(spec.output_dir)
    with world.main_first("checking the inputs"):
        checked = prepare_run(spec, out, world)
    identities = stage_identities(spec, checked.prepared.inputs, checked.prepared.data)
    created = not out.exists()
    try:
        with (
            RunLock(out) if world.is_main else nullcontext(),
            fixed_precision(spec.precision),
            torch_threads(checked.threads),
        ):
            run = _Run(spec, out, checked.prepared, identities, device, world)
            world.barrier("reading the run folder")  # every process has read the ledger before rank 0 changes it
            return run.execute(checked.record)
    except BaseException:
        if world.is_main and created and not (out / STAGES_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)  # nothing finished: leave no half-made folder
        raise


class _LazyModel:
    """A model loaded on first call and kept until dropped (``value`` may be set to one already made)."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self.value: Any = None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self._load()
        return self.value

    def drop(self) -> None:
        self.value = None


class _Run:
    """The steps of one locked run over a run folder, skipping those already done.

    Under torchrun every process runs the same steps, with the same skip decisions (each keeps the
    ledger in memory); rank 0 alone writes (``self.writes``).
    """

    def __init__(
        self,
        spec: RunSpec,
        out: Path,
        prepared: Prepared,
        identities: Mapping[str, str],
        device: torch.device,
        world: World = SINGLE,
    ) -> None:
        inputs = prepared.inputs
        self.spec, self.out, self.inputs, self.identities = spec, out, inputs, identities
        self.data = prepared.data  # what validation learnt of the datasets: recorded beside a data-using merge
        self.family = inputs.family
        self.device, self.evaluator, self.preprocessor = device, prepared.evaluator, prepared.preprocessor
        self.world, self.writes = world, world.is_main
        ledger = StageLedger(out, writes=self.writes) if spec.force else StageLedger.read(out, writes=self.writes)
        self.ledger = ledger
        self.executor = StepExecutor(ledger, MemoryMeter(device))
        self.record: RunRecord | None = None
        self.run_id = ""
        self._test_data: Any = None
        self.merged_name = merged_stage_name(spec.merge_method)
        self.calibrated_name = calibrated_stage_name(spec.merge_method)
        self.merged_folder = Path(spec.ta_model_path) if spec.skip_ta else out / self.merged_name
        # The merge's result while it is in memory, else read from its folder when needed (skip_ta's
        # model, a merge done earlier, or after the calibration); the calibration writes its model layer
        # by layer: read back from its folder.
        self.merged = _LazyModel(lambda: self.family.load_model(self.merged_folder, inputs.base))
        self.calibrated = _LazyModel(lambda: self.family.load_model(out / self.calibrated_name, inputs.base))

    # --- the table of steps ---------------------------------------------------------------------
    def _step(self, name: str, run: Callable[[], Any], outputs: tuple[str, ...], **kw: Any) -> Step:
        return Step(name, self.identities[name], outputs, run, **kw)

    def _evaluation(
        self,
        folder: str,
        model: Callable[[], Any],
        *,
        extra: Mapping[str, Any] | None = None,
        weights_of: str | None = None,
    ) -> Step:
        """The evaluation of ``model`` whose report is written into ``folder`` (for a merged model the run did
        not make, ``skip_ta``, a folder of the report alone). With ``weights_of`` (the model's step), the
        report records the weights it measured, and holds only while the stage's weights are those."""

        def run() -> MetricsReport:
            report = self.evaluator.evaluate(
                model(), self.inputs.tasks, data=self.test_data(), progress=self.spec.progress
            )
            measured = {WEIGHTS_SHA256: self._stage_weights(weights_of, folder)} if weights_of else {}
            report = report.with_extra({k: v for k, v in {**(extra or {}), **measured}.items() if v})
            if self.writes:
                write_stage_report(self.out / folder, report, self.run_id)
            return report

        def measured_these_weights() -> bool:
            recorded = read_json(self.out / folder / METRICS).get(WEIGHTS_SHA256) if self.writes else None
            return not self.writes or recorded == self._stage_weights(weights_of, folder)

        name = evaluate_step(folder)
        outputs = (folder,) if folder == ZERO_SHOT_DIR else (f"{folder}/{METRICS}", f"{folder}/{RUN_LOG}")
        return Step(
            name, self.identities[name], outputs, run, done=lambda: self._restamped(folder),
            measure=evaluation_step(folder), label=f"Evaluation of {folder}/",
            valid=measured_these_weights if weights_of else None,
        )  # fmt: skip

    def _stage_weights(self, step: str, folder: str) -> dict[str, str]:
        """The SHA-256 of the weight files of a model stage's folder, as the ledger recorded them when the
        stage's step ended, by path in the folder (a merged folder the run did not make: hashed now)."""
        if step == MERGE_STEP and self.spec.skip_ta:
            return weights_sha256(self.merged_folder)
        recorded = (self.ledger.done.get(step) or {}).get("weights") or {}
        prefix = f"{folder}/"
        return {path.removeprefix(prefix): sha for path, (_, sha) in recorded.items() if path.startswith(prefix)}

    def steps(self) -> list[Step]:
        """The run's steps after the evaluation of the zero-shot base, in order."""
        spec, table = self.spec, []
        if spec.eval_experts:
            name = evaluate_step(EXPERTS_DIR)
            table.append(
                Step(name, self.identities[name], (EXPERTS_DIR,), self._evaluate_experts,
                     done=lambda: self._restamped(EXPERTS_DIR), measure=evaluation_step(EXPERTS_DIR),
                     label="Evaluation of the experts")
            )  # fmt: skip
        if not spec.skip_ta:
            table.append(
                self._step(
                    MERGE_STEP,
                    self._merge,
                    (self.merged_name,),
                    measure=MERGE_STEP,
                    label=f"Merge: {self.merged_name}/",
                )
            )
        if not spec.skip_eval_ta:
            table.append(self._evaluation(self.merged_name, self.merged, weights_of=MERGE_STEP))
        if not spec.skip_featcal:
            table.append(
                self._step(CALIBRATE_STEP, self._calibrate, (self.calibrated_name,), measure=CALIBRATE_STEP,
                           label=f"FeatCal: {self.calibrated_name}/")
            )  # fmt: skip
            used = {"calibration_examples_used": dict(self.record.calibration_examples_used)}
            table.append(self._evaluation(self.calibrated_name, self.calibrated, extra=used, weights_of=CALIBRATE_STEP))
        if spec.diagnose:
            outputs = (DIAGNOSTICS, DIAGNOSTICS_PLOT)
            table.append(
                self._step(
                    DIAGNOSE_STEP, self._diagnose, outputs, measure=DIAGNOSE_STEP, label=f"Feature drift: {DIAGNOSTICS}"
                )
            )
        return table

    # --- walking it -----------------------------------------------------------------------------
    def execute(self, record: RunRecord) -> dict[str, MetricsReport]:
        spec, out, inputs, executor = self.spec, self.out, self.inputs, self.executor
        if self.writes:
            remove_leftovers(out)
        self.record, self.run_id = record, record.run_id
        # with --force the ledger starts empty: every earlier stage folder goes
        clear_stale(
            out, self.ledger, self.identities, merge_method=spec.merge_method, run_id=self.run_id, writes=self.writes
        )
        if self.writes:
            write_run_config(out, record, processes=self.world.record())
        fault_point("after:run_config")
        if self.writes and (out / TIMINGS).is_file() and self.ledger.done:
            executor.timings = {k: float(v) for k, v in read_json(out / TIMINGS).items() if isinstance(v, (int, float))}
        results: dict[str, MetricsReport] = {}
        if spec.eval_zero_shot:
            results[ZERO_SHOT_DIR] = executor.run(self._evaluation(ZERO_SHOT_DIR, self.evaluator.base_model))
        steps = self.steps()
        # From here on only what the evaluations need of the base is kept (CLIP's class heads): the
        # base leaves memory before the merge.
        evaluations = [s for s in steps if s.name.startswith(evaluate_step(""))]
        self.evaluator.prepare(inputs.tasks if executor.pending(evaluations) else [])
        for step in steps:
            result = executor.run(step)
            if isinstance(result, MetricsReport):
                results[step.name.removeprefix(evaluate_step(""))] = result
        self.merged.drop()
        self.calibrated.drop()
        if not self.writes:
            return results
        self._write_timings()
        if not spec.no_export and (not spec.skip_featcal or not (spec.skip_ta or spec.skip_eval_ta)):
            with executor.measured(EXPORT_STEP, timed=False):
                exported = self._export()
            if exported:
                self._write_timings()  # with the export's peak (the card was written from the first)
        return results

    # --- the steps' work ------------------------------------------------------------------------
    def test_data(self) -> Any:
        """The run's test examples, loaded on first use; their loader serves every evaluation."""
        if self._test_data is None:
            self._test_data = self.evaluator.test_data(
                self.inputs.tasks,
                batch_size=self.spec.eval_batch_size,
                num_workers=self.spec.eval_num_workers,
                max_samples=self.spec.max_eval_samples,
            )
        return self._test_data

    def _release_test_data(self) -> None:
        """Forget the test examples before the calibration when this process reads them itself.

        Without loader workers, the pages of the test splits' memory-mapped files that the evaluation
        read stay in this process's resident memory (0.25 GB for 8 × 256 images at 224 px) and would add
        to the calibration's peak; they are opened again, from the datasets cache, for the next
        evaluation. With workers, the workers read them and the loader is kept, so that they start
        once per run.
        """
        loader = getattr(self._test_data, "loader", None)
        if loader is not None and loader.num_workers == 0:
            self._test_data = None

    def _merge(self) -> None:
        spec, data, calibration = self.spec, None, None
        if merges_from_data(spec):  # the draw FeatCal reads too: one draw for both
            data = merge_data(
                self.inputs, self.preprocessor, spec.featcal, spec.seed, world=self.world, progress=spec.progress
            )
            calibration = merge_calibration(
                spec.featcal, spec.seed, self.data.calibration_counts, self.data.fingerprints, self.inputs.tasks
            )
        state = merge(
            self.inputs, spec.merge_method, self.device, world=self.world, data=data, output_dtype=spec.output_dtype
        )
        if self.writes:
            save_merge(
                self.inputs, spec.merge_method, state, self.out / self.merged_name, calibration,
                output_dtype=spec.output_dtype,
            )  # fmt: skip
        self.merged.value = self.family.build_model(self.inputs.config, state)  # its values checked by merge()

    def _calibrate(self) -> None:
        merged_here = self.merged.value is not None
        self._release_test_data()
        self.merged.drop()  # the calibration reads the merged layers from their folder, one at a time
        release_free_memory()
        self.world.barrier("writing the merged model")  # rank 0 wrote the folder the others read
        if not (self.spec.skip_ta or merged_here):  # a merge read back is checked (--ta-model-path was, up front)
            self.family.check_model_folder(self.merged_folder, self.inputs.base)
        calibrate(
            self.inputs, self.merged_folder, self.out / self.calibrated_name if self.writes else None,
            self.spec.featcal, seed=self.spec.seed, device=self.device, preprocessor=self.preprocessor,
            progress=self.spec.progress, world=self.world, precision=self.spec.precision,
            counts=self.record.calibration_examples_used, output_dtype=self.spec.output_dtype,
            stream_storage=self.spec.stream_storage,
        )  # fmt: skip
        self.world.barrier("writing the calibrated model")

    def _evaluate_experts(self) -> MetricsReport:
        per_task = {
            task.name: self.evaluator.evaluate_task(
                self.family.build_model(self.inputs.config, self.inputs.experts[task.name]), task,
                data=self.test_data(), progress=self.spec.progress,
            )
            for task in self.inputs.tasks
        }  # fmt: skip
        report = MetricsReport.from_results(per_task)
        if self.writes:
            write_stage_report(self.out / EXPERTS_DIR, report, self.run_id)
        return report

    def _diagnose(self) -> None:
        """The feature drift of the merged (and calibrated) model from the experts: diagnostics.json and plot."""
        from featcal.diagnostics.run import diagnose_models, drift_inputs, write_diagnostics

        spec, tasks = self.spec, self.inputs.tasks
        models = {MERGED: self.merged} if spec.skip_featcal else {MERGED: self.merged, CALIBRATED: self.calibrated}
        fewer = self.record.calibration_examples_used
        counts = {t.name: fewer.get(t.name, spec.featcal.num_calibration_examples) for t in tasks}
        load = drift_inputs(
            self.family, tasks, self.preprocessor, split=spec.diagnose_split, num_examples=spec.diagnose_images,
            seed=spec.seed, calibration_counts=counts,
        )  # fmt: skip
        report = diagnose_models(
            {name: model() for name, model in models.items()}, self.inputs.experts, load,
            adapter=self.family.adapter(), method=spec.merge_method, split=spec.diagnose_split, run_id=self.run_id,
            device=self.device, batch_size=spec.eval_batch_size or default_eval_batch_size(self.device),
            progress=spec.progress,
        )  # fmt: skip
        if self.writes:  # every process computed the drift (it is not shared out); rank 0 writes it
            write_diagnostics(self.out, report)

    # --- the folder's state ---------------------------------------------------------------------
    def _write_timings(self) -> None:
        if self.writes:
            write_timings(
                self.out, self.executor.timings, self.executor.memory.report(),
                {"torch_threads": torch.get_num_threads()},
            )  # fmt: skip

    def _restamped(self, folder: str) -> MetricsReport:
        """A finished stage's report, restamped with this run's id by rank 0."""
        return stage_report(self.out / folder, self.run_id, writes=self.writes)

    def _export(self) -> bool:
        """Write the release folder unless it is up to date; whether it was written."""
        from featcal.release.export import export_release

        identity = export_identity(self.ledger, self.run_id)
        if self.ledger.is_done(EXPORT_STEP, identity) and (self.out / RELEASE_DIR).is_dir():
            logger.info("Release: %s/ is up to date; skipped", RELEASE_DIR)
            return False
        export_release(self.out)
        self.executor.mark(Step(EXPORT_STEP, identity, (RELEASE_DIR,), lambda: None))
        return True
