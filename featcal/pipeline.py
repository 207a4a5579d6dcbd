"""The stages of a run, over a :class:`~featcal.spec.RunSpec` and a run folder.

merge → evaluate → calibrate → evaluate → export, each stage writing through
:mod:`featcal.runfolder` into the reference run's layout, skipped when the folder already holds its
result from the same inputs. Inputs are resolved and checked by :mod:`featcal.inputs` before the
first file is written.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal.calibration.params import FeatCalParams
from featcal.calibration.streaming import featcal_calibrate_folder
from featcal.data import TestImages, calibration_pixels
from featcal.diagnostics.report import CALIBRATED, MERGED
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError, FeatcalError, InvalidParameterError
from featcal.evaluation import IMAGE_PROCESSOR, ZeroShotClassifier, default_eval_batch_size, load_base_clip
from featcal.fingerprints import digest, folder_fingerprint
from featcal.inputs import (
    DatasetFacts,
    RunInputs,
    build_vision_model,
    check_same_run,
    check_vision_folder,
    load_vision_folder,
    resolve_inputs,
    validate_datasets,
)
from featcal.io import config_hash, fault_point, read_json, save_vision_model
from featcal.memory import MemoryMeter, release_free_memory
from featcal.merging import get_method
from featcal.outputs import check_run_output_folder
from featcal.precision import fixed_precision, forward_dtype
from featcal.runfolder import (
    DIAGNOSTICS,
    DIAGNOSTICS_PLOT,
    EXPERTS_DIR,
    METRICS,
    RELEASE_DIR,
    RUN_CONFIG,
    RUN_LOG,
    STAGES_FILE,
    TIMINGS,
    ZERO_SHOT_DIR,
    MetricsReport,
    RunLock,
    StageLedger,
    calibrated_stage_name,
    merged_stage_name,
    remove_leftovers,
    restamp_report,
    write_run_config,
    write_stage_report,
    write_timings,
)
from featcal.spec import RunSpec
from featcal.suites import DEFAULT_BACKBONE, DEFAULT_SUITE
from featcal.tasks import Task
from featcal.threads import choose_threads, torch_threads
from featcal.version import __version__

logger = logging.getLogger(__name__)


def run_record(spec: RunSpec, inputs: RunInputs, calibration_counts: Mapping[str, int] | None = None) -> dict:
    """What ``run_config.json`` records: the spec's reproducible part, with tasks and models resolved.

    Its hash is the run's id (``run_id``, and ``recipe_sha256`` in the released weights). When some
    task's train split holds fewer images than ``num_calibration_examples`` (and that was allowed),
    the FeatCal section records the number each such task used.
    """
    featcal: dict[str, Any] | None = None if spec.skip_featcal else spec.featcal.to_dict()
    if featcal is not None and calibration_counts:
        featcal["calibration_examples_used"] = dict(calibration_counts)
    return {
        "featcal_version": __version__,
        "base_model_id": inputs.base_ref,
        "experts": inputs.expert_refs,
        "tasks": [t.name for t in inputs.tasks],
        **suite_record(spec),
        "tasks_table": {t.name: t.to_dict() for t in inputs.tasks},
        "seed": spec.seed,
        "merge": {
            "method": spec.merge_method,
            "params": inputs.merge_params,
            "from": spec.ta_model_path if spec.skip_ta else None,
        },
        "featcal": featcal,
        "evaluation": {"max_eval_samples": spec.max_eval_samples, "image_processor": IMAGE_PROCESSOR},
        "precision": spec.precision,
    }


def suite_record(spec: RunSpec) -> dict[str, str]:
    """The suite and backbone chosen, when not the defaults (``ta8``, ``b32``).

    The tasks, models and references they select are recorded in full anyway; leaving the defaults
    out keeps the record, and so the run id, of runs made before suites could be chosen.
    """
    chosen = {"suite": (spec.suite, DEFAULT_SUITE), "backbone": (spec.backbone, DEFAULT_BACKBONE)}
    return {key: value for key, (value, default) in chosen.items() if value != default}


def check_calibration_shares(tasks: Sequence[Task], counts: Mapping[str, int], requested: int, world: World) -> None:
    """Refuse, before anything is written, a task with fewer calibration images than processes.

    Args:
        tasks: The run's tasks.
        counts: Images used by each task whose train split is smaller than ``requested``.
        requested: ``num_calibration_examples``.
        world: The processes, each of which takes a part of every task's images.

    Raises:
        DatasetInputError: naming the task and the largest number of processes it allows.
    """
    for task in tasks:
        count = counts.get(task.name, requested)
        if count < world.size:
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: its {count} calibration image(s) cannot be split over {world.size} "
                f"processes; start at most {count} processes, or raise `num_calibration_examples`.",
            )


def check_finite(state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise naming the first non-finite tensor of a result computed from finite inputs."""
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FeatcalError(f"{what}: tensor {key!r} is not finite, although every input is.")


def merge(
    inputs: RunInputs, method: str, device: torch.device | None = None, *, world: World = SINGLE
) -> dict[str, torch.Tensor]:
    """The merged vision tower's state dict (on the CPU), computed on ``device`` (shared by ``world``'s processes)."""
    experts = [inputs.experts[t.name] for t in inputs.tasks]
    merged = get_method(method)(inputs.base, experts, device=device, world=world, **inputs.merge_params)
    check_finite(merged, f"The {method} merge")
    return merged


def calibrate(
    inputs: RunInputs,
    merged_folder: str | Path,
    output: str | Path | None,
    params: FeatCalParams,
    *,
    seed: int,
    device: torch.device,
    processor,
    progress: bool = True,
    world: World = SINGLE,
    precision: str = "float32",
) -> None:
    """FeatCal of the merged model in ``merged_folder`` (checked by the caller), written to ``output``
    one encoder layer at a time: the model is never whole in memory, and the folder appears only when
    the calibration ends. Under torchrun each of ``world``'s processes reads its part of every task's
    calibration images, and all compute the same weights; the others pass ``output`` None.
    ``precision`` ``bf16`` runs the layer forwards under bfloat16 autocast."""
    by_name = {t.name: t for t in inputs.tasks}
    featcal_calibrate_folder(
        merged_folder,
        output,
        inputs.base,
        inputs.experts,
        lambda name: calibration_pixels(by_name[name], processor, params.num_calibration_examples, seed, world=world),
        params,
        vision_config=inputs.vision_config,
        device=device,
        progress=progress,
        world=world,
        forward_dtype=forward_dtype(precision),
    )


@dataclass(frozen=True)
class Stage:
    """One resumable step of a run: its ledger name, the identity of its inputs, what it writes."""

    name: str
    identity: str
    outputs: list[str]


def plan_stages(spec: RunSpec, inputs: RunInputs, data: DatasetFacts) -> dict[str, Stage]:
    """Every stage whose identity this run can compute, by name (requested or not).

    Each identity covers exactly what the stage's result depends on, and the identities of the
    stages it reads from, so a change redoes that stage and everything after it.
    """
    merged, calibrated = merged_stage_name(spec.merge_method), calibrated_stage_name(spec.merge_method)
    base = folder_fingerprint(inputs.base_folder)
    experts = [folder_fingerprint(inputs.experts[t.name].path) for t in inputs.tasks if t.name in inputs.experts]
    tests = [data.fingerprints[t.name].get("test") for t in inputs.tasks]
    trains = [data.fingerprints[t.name].get("train") for t in inputs.tasks]
    table = {t.name: t.to_dict() for t in inputs.tasks}
    evaluation = digest("evaluation", __version__, base, table, tests, spec.max_eval_samples)
    stages = [
        Stage(f"evaluate:{ZERO_SHOT_DIR}", digest(evaluation), [ZERO_SHOT_DIR]),
        Stage(f"evaluate:{EXPERTS_DIR}", digest(evaluation, experts), [EXPERTS_DIR]),
    ]
    if not spec.skip_ta:
        merge_id = digest("merge", __version__, spec.merge_method, inputs.merge_params, base, experts)
        calibrate_from = merge_id
        stages += [
            Stage("merge", merge_id, [merged]),
            Stage(f"evaluate:{merged}", digest(evaluation, merge_id), [f"{merged}/{METRICS}", f"{merged}/{RUN_LOG}"]),
        ]
    else:
        calibrate_from = digest("from", folder_fingerprint(spec.ta_model_path))
    # bf16 forwards change the calibrated weights and are part of the identity; tf32, which changes only
    # the rounding of CUDA matmuls, is not (a tf32 run reuses a float32 calibration, and the reverse).
    forwards = ["forwards", spec.precision] if spec.precision == "bf16" else []
    calibrate_id = digest(
        "calibrate", __version__, calibrate_from, spec.featcal.to_dict(), spec.seed, base, experts, trains,
        data.calibration_counts, *forwards,
    )  # fmt: skip
    stages += [
        Stage("calibrate", calibrate_id, [calibrated]),
        Stage(
            f"evaluate:{calibrated}",
            digest(evaluation, calibrate_id),
            [f"{calibrated}/{METRICS}", f"{calibrated}/{RUN_LOG}"],
        ),
    ]
    split = "train" if spec.diagnose_split == "calibration" else "test"
    diagnose_id = digest(
        "diagnose", __version__, calibrate_id, spec.skip_featcal, experts, spec.diagnose_split, spec.diagnose_images,
        [data.fingerprints[t.name].get(split) for t in inputs.tasks],
    )  # fmt: skip
    stages.append(Stage("diagnose", diagnose_id, [DIAGNOSTICS, DIAGNOSTICS_PLOT]))
    return {stage.name: stage for stage in stages}


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
        check_run_output_folder(out)
        merged_from = Path(spec.ta_model_path).resolve() if spec.skip_ta else None
        if merged_from is not None and out.resolve() in (merged_from, *merged_from.parents):
            raise InvalidParameterError(
                "ta_model_path", spec.ta_model_path, "a folder outside the output folder, whose stage folders the run "
                "replaces (run without skip_ta to reuse the run's own merge, or copy the folder elsewhere)",
            )  # fmt: skip
        torch.manual_seed(spec.seed)
        need_experts = not (spec.skip_ta and spec.skip_featcal and not spec.eval_experts)
        inputs = resolve_inputs(spec, need_experts=need_experts)
        data = validate_datasets(
            inputs.tasks,
            ("test",) if spec.skip_featcal else ("train", "test"),
            calibration_examples=None if spec.skip_featcal else spec.featcal.num_calibration_examples,
            allow_fewer=spec.allow_fewer_calibration_examples,
        )
        if not spec.skip_featcal:
            check_calibration_shares(
                inputs.tasks, data.calibration_counts, spec.featcal.num_calibration_examples, world
            )
        record = run_record(spec, inputs, data.calibration_counts)
        if not spec.force:
            check_same_run(out, record)
        threads = choose_threads(spec.threads, inputs.vision_config.hidden_size)
        clip, tokenizer, processor = load_base_clip(inputs.base_folder, device)
        # A merged model to start from is checked before the folder is touched (and read when needed).
        if spec.skip_ta:
            check_vision_folder(spec.ta_model_path, inputs.base)
    stages = plan_stages(spec, inputs, data)
    created = not out.exists()
    classifier = ZeroShotClassifier(clip, tokenizer, device, world=world)
    del clip, tokenizer  # the classifier's alone, so that keep_heads_only frees the tokenizer
    try:
        with RunLock(out) if world.is_main else nullcontext(), fixed_precision(spec.precision), torch_threads(threads):
            run = _Run(spec, out, inputs, stages, device, classifier, processor, world)
            world.barrier("reading the run folder")  # every process has read the ledger before rank 0 changes it
            return run.execute(record)
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
    """The stages of one locked run over a run folder, skipping those already done.

    Under torchrun every process runs the same stages, with the same skip decisions (each keeps
    the ledger in memory); rank 0 alone writes (``self.writes``).
    """

    def __init__(self, spec, out, inputs, stages, device, classifier, processor, world: World = SINGLE) -> None:
        self.spec, self.out, self.inputs, self.stages = spec, out, inputs, stages
        self.device, self.classifier, self.processor = device, classifier, processor
        self.world, self.writes = world, world.is_main
        self.ledger = StageLedger(out, writes=self.writes) if spec.force else StageLedger.read(out, writes=self.writes)
        self.run_id = ""
        self.timings: dict[str, float] = {}
        self.memory = MemoryMeter(device)
        self._images: TestImages | None = None

    @contextmanager
    def _stage(self, key: str, timed: bool = True) -> Iterator[None]:
        """Measure the body as stage ``key``: its peak memory, and with ``timed`` its seconds as ``<key>_s``.
        What earlier stages freed is handed back to the system first, so it does not count here."""
        release_free_memory()
        start = time.perf_counter()
        with self.memory.stage(key):
            yield
        if timed:
            self.timings[f"{key}_s"] = time.perf_counter() - start

    def _write_timings(self) -> None:
        if self.writes:
            write_timings(self.out, self.timings, self.memory.report(), {"torch_threads": torch.get_num_threads()})

    def _save(self, state: Mapping[str, torch.Tensor], name: str) -> None:
        """Save a model folder of the run (rank 0 only)."""
        if self.writes:
            save_vision_model(state, self.inputs.vision_config, self.out / name)

    def _report(self, folder: str, report: MetricsReport) -> None:
        """Write a stage's report (rank 0 only)."""
        if self.writes:
            write_stage_report(self.out / folder, report, self.run_id)

    def _restamped(self, folder: str) -> MetricsReport:
        """A finished stage's report, restamped with this run's id by rank 0."""
        if self.writes:
            return restamp_report(self.out / folder, self.run_id)
        return MetricsReport.from_json(read_json(self.out / folder / METRICS)).with_run_id(self.run_id)

    @property
    def images(self) -> TestImages:
        """The run's test images, loaded on first use; their loader serves every evaluation."""
        if self._images is None:
            self._images = self.classifier.test_images(
                self.inputs.tasks,
                self.processor,
                batch_size=self.spec.eval_batch_size,
                num_workers=self.spec.eval_num_workers,
                max_samples=self.spec.max_eval_samples,
            )
        return self._images

    def _release_test_images(self) -> None:
        """Forget the test images before the calibration when this process reads them itself.

        Without loader workers, the pages of the test splits' memory-mapped files that the evaluation
        read stay in this process's resident memory (0.25 GB for 8 × 256 images at 224 px) and would add
        to the calibration's peak; they are opened again, from the datasets cache, for the next
        evaluation. With workers, the workers read them and the loader is kept, so that they start
        once per run.
        """
        if self._images is not None and self._images.loader.num_workers == 0:
            self._images = None

    def execute(self, record: Mapping[str, Any]) -> dict[str, MetricsReport]:
        spec, out, inputs = self.spec, self.out, self.inputs
        if self.writes:
            remove_leftovers(out)
        self.run_id = config_hash(record)
        self._clear_stale()  # with --force the ledger starts empty: every earlier stage folder goes
        if self.writes:
            write_run_config(out, record, processes=self.world.record())
        fault_point("after:run_config")
        if self.writes and (out / TIMINGS).is_file() and self.ledger.done:
            self.timings = {k: float(v) for k, v in read_json(out / TIMINGS).items() if isinstance(v, (int, float))}
        merged_name = merged_stage_name(spec.merge_method)
        calibrated_name = calibrated_stage_name(spec.merge_method)
        results: dict[str, MetricsReport] = {}
        if spec.eval_zero_shot:
            results[ZERO_SHOT_DIR] = self._evaluate(ZERO_SHOT_DIR, lambda: self.classifier.clip.vision_model)
        # From here on only the class heads are needed: the base's towers leave memory before the merge.
        self.classifier.keep_heads_only(inputs.tasks if self._needs_heads() else [])
        if spec.eval_experts:
            results[EXPERTS_DIR] = self._evaluate_experts()

        # The merge's result while it is in memory, else read from its folder when needed (--skip-ta's
        # model, a merge done earlier, or after the calibration).
        merged_folder = Path(spec.ta_model_path) if spec.skip_ta else out / merged_name
        merged = _LazyModel(lambda: load_vision_folder(merged_folder, inputs.base))
        if spec.skip_ta:
            pass  # nothing to merge
        elif self._fresh("merge"):
            logger.info("Merge: %s/ is up to date (same inputs); skipped", merged_name)
        else:
            with self._stage("merge"):
                state = merge(inputs, spec.merge_method, self.device, world=self.world)
                self._save(state, merged_name)
                merged.value = build_vision_model(inputs, state)  # its values checked finite by merge()
                del state
            self._mark("merge")
        merged_here = merged.value is not None

        if not spec.skip_eval_ta:
            if spec.skip_ta:  # the merged model comes from elsewhere: reported, not written
                with self._stage(f"eval_{merged_name}"):
                    results[merged_name] = self.classifier.evaluate(
                        merged(), inputs.tasks, progress=spec.progress, images=self.images
                    )
            else:
                results[merged_name] = self._evaluate(merged_name, merged)

        # The calibration wrote it, layer by layer: read back from its folder.
        calibrated = _LazyModel(lambda: load_vision_folder(out / calibrated_name, inputs.base))

        if not spec.skip_featcal:
            if self._fresh("calibrate"):
                logger.info("FeatCal: %s/ is up to date (same inputs); skipped", calibrated_name)
            else:
                self._release_test_images()
                merged.drop()  # the calibration reads the merged layers from their folder, one at a time
                release_free_memory()
                self.world.barrier("writing the merged model")  # rank 0 wrote the folder the others read
                if not (spec.skip_ta or merged_here):  # a merge read back is checked (--ta-model-path was, up front)
                    check_vision_folder(merged_folder, inputs.base)
                with self.memory.stage("calibrate"):
                    start = time.perf_counter()
                    calibrate(
                        inputs, merged_folder, out / calibrated_name if self.writes else None, spec.featcal,
                        seed=spec.seed, device=self.device, processor=self.processor, progress=spec.progress,
                        world=self.world, precision=spec.precision,
                    )  # fmt: skip
                    self.timings["calibrate_s"] = time.perf_counter() - start
                self.world.barrier("writing the calibrated model")
                self._mark("calibrate")
            results[calibrated_name] = self._evaluate(
                calibrated_name,
                calibrated,
                extra={"calibration_examples_used": record["featcal"].get("calibration_examples_used")},
            )
        if spec.diagnose:
            models = {MERGED: merged}
            if not spec.skip_featcal:
                models[CALIBRATED] = calibrated
            self._diagnose(models, (record["featcal"] or {}).get("calibration_examples_used") or {})
        merged.drop()
        calibrated.drop()
        if not self.writes:
            return results
        self._write_timings()
        if not spec.no_export and (not spec.skip_featcal or not (spec.skip_ta or spec.skip_eval_ta)):
            with self._stage("export", timed=False):
                exported = self._export()
            if exported:
                self._write_timings()  # with the export's peak (the card was written from the first)
        return results

    def _needs_heads(self) -> bool:
        """Whether any evaluation stage of this run is still to do (else no class head is needed)."""
        spec = self.spec
        merged, calibrated = merged_stage_name(spec.merge_method), calibrated_stage_name(spec.merge_method)
        wanted = [EXPERTS_DIR] if spec.eval_experts else []
        wanted += [] if spec.skip_eval_ta else [merged]
        wanted += [] if spec.skip_featcal else [calibrated]
        return any((spec.skip_ta and folder == merged) or not self._fresh(f"evaluate:{folder}") for folder in wanted)

    def _diagnose(self, models: Mapping[str, Any], fewer: Mapping[str, int]) -> None:
        """The feature drift of the merged (and calibrated) model from the experts: diagnostics.json and plot.

        ``models`` gives each model by name through a function that loads it; ``fewer`` the
        calibration images of the tasks that had fewer than asked for.
        """
        from featcal.diagnostics.run import diagnose_models, drift_images, write_diagnostics

        if self._fresh("diagnose"):
            logger.info("Feature drift: %s is up to date (same inputs); skipped", DIAGNOSTICS)
            return
        spec, tasks = self.spec, self.inputs.tasks
        with self._stage("diagnose"):
            counts = {t.name: fewer.get(t.name, spec.featcal.num_calibration_examples) for t in tasks}
            load = drift_images(
                tasks, self.processor, split=spec.diagnose_split, num_images=spec.diagnose_images, seed=spec.seed,
                calibration_counts=counts,
            )  # fmt: skip
            report = diagnose_models(
                {name: model() for name, model in models.items()}, self.inputs.experts, load,
                method=spec.merge_method, split=spec.diagnose_split, run_id=self.run_id, device=self.device,
                batch_size=spec.eval_batch_size or default_eval_batch_size(self.device), progress=spec.progress,
            )  # fmt: skip
            if self.writes:  # every process computed the drift (it is not shared out); rank 0 writes it
                write_diagnostics(self.out, report)
        self._mark("diagnose")

    def _fresh(self, name: str) -> bool:
        return self.ledger.is_done(name, self.stages[name].identity)

    def _mark(self, name: str) -> None:
        self.ledger.mark(name, self.stages[name].identity, self.stages[name].outputs)
        fault_point(f"after:{name}")

    def _clear_stale(self) -> None:
        """Remove outputs whose inputs changed, of stages this run cannot produce, and any release
        that is not of exactly this run; a run folder without a ledger is redone whole."""
        if self.writes and not self.ledger.done and (self.out / RUN_CONFIG).is_file():
            self._clear_unrecorded()
        stale = [n for n in self.ledger.done if n != "export" and (n not in self.stages or not self._fresh(n))]
        # A stage whose outputs lie in a stale stage's folder (ta/metrics.json in ta/) goes with it.
        removed = [path for name in stale for path in self.ledger.done[name].get("outputs", [])]
        stale += [
            name
            for name, entry in self.ledger.done.items()
            if name != "export" and name not in stale
            and any(out.startswith(f"{path}/") for out in entry.get("outputs", []) for path in removed)
        ]  # fmt: skip
        for name in stale:
            logger.info("%s: inputs or outputs changed; its earlier output is removed and redone", name)
            self.ledger.discard(name)
        export = self.ledger.done.get("export")
        if export is not None and export.get("identity") != self._export_identity():
            self.ledger.discard("export")

    def _clear_unrecorded(self) -> None:
        """Stage folders of an earlier run that recorded no ledger (or was forced): all redone."""
        try:
            old = read_json(self.out / RUN_CONFIG)
        except ValueError:  # damaged: replaced under --force like any other run
            old = {}
        old = old if isinstance(old, dict) else {}
        merge = old.get("merge") if isinstance(old.get("merge"), dict) else {}
        methods = {self.spec.merge_method, merge.get("method", self.spec.merge_method)}
        names = {ZERO_SHOT_DIR, EXPERTS_DIR, RELEASE_DIR}
        names |= {merged_stage_name(m) for m in methods} | {calibrated_stage_name(m) for m in methods}
        for name in sorted(names):
            if (self.out / name).is_dir():
                shutil.rmtree(self.out / name)
        for name in (TIMINGS, DIAGNOSTICS, DIAGNOSTICS_PLOT):
            (self.out / name).unlink(missing_ok=True)

    def _evaluate(self, folder: str, model: Any, extra: Mapping[str, Any] | None = None) -> MetricsReport:
        name = f"evaluate:{folder}"
        if self._fresh(name):
            logger.info("Evaluation of %s/ is up to date (same inputs); skipped", folder)
            return self._restamped(folder)
        with self._stage(f"eval_{folder}"):
            report = self.classifier.evaluate(
                model(), self.inputs.tasks, progress=self.spec.progress, images=self.images
            )
        report = report.with_extra({k: v for k, v in (extra or {}).items() if v})
        self._report(folder, report)
        self._mark(name)
        return report

    def _evaluate_experts(self) -> MetricsReport:
        name = f"evaluate:{EXPERTS_DIR}"
        if self._fresh(name):
            logger.info("Evaluation of the experts is up to date (same inputs); skipped")
            return self._restamped(EXPERTS_DIR)
        with self._stage(f"eval_{EXPERTS_DIR}"):
            per_task = {
                task.name: self.classifier.evaluate_task(
                    build_vision_model(self.inputs, self.inputs.experts[task.name]), task,
                    progress=self.spec.progress, images=self.images,
                )
                for task in self.inputs.tasks
            }  # fmt: skip
        report = MetricsReport.from_results(per_task)
        self._report(EXPERTS_DIR, report)
        self._mark(name)
        return report

    def _export_identity(self) -> str:
        return digest("export", __version__, self.run_id, sorted(
            (name, entry.get("identity"), entry.get("weights"))
            for name, entry in self.ledger.done.items() if name != "export"
        ))  # fmt: skip

    def _export(self) -> bool:
        """Write the release folder unless it is up to date; whether it was written."""
        from featcal.release import export_release

        identity = self._export_identity()
        if self.ledger.is_done("export", identity) and (self.out / RELEASE_DIR).is_dir():
            logger.info("Release: %s/ is up to date; skipped", RELEASE_DIR)
            return False
        export_release(self.out)
        self.ledger.mark("export", identity, [RELEASE_DIR])
        fault_point("after:export")
        return True
