"""The stages of a run, over a :class:`~featcal.spec.RunSpec` and a run folder.

merge → evaluate → calibrate → evaluate, each stage writing through :mod:`featcal.runfolder` into
the reference run's layout. Inputs are resolved and checked (tasks, models, datasets, the merge)
before the first file is written.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from featcal import __version__
from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.checkpoint import Checkpoint, check_compatible, check_same_architecture
from featcal.data import calibration_pixels, load_task_split
from featcal.errors import DatasetInputError, FeatcalError, InvalidParameterError, ModelInputError, RunFolderError
from featcal.evaluation import ZeroShotClassifier, check_clip_model_folder, load_base_clip
from featcal.fingerprints import dataset_fingerprint, digest, folder_fingerprint
from featcal.hub import resolve_model_folder
from featcal.io import config_hash, fault_point, read_json, save_vision_model
from featcal.merging import get_method
from featcal.runfolder import (
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
from featcal.tasks import Task, task_table

logger = logging.getLogger(__name__)


@dataclass
class RunInputs:
    """A run's resolved inputs: tasks, model folders and lazily-read checkpoints."""

    tasks: list[Task]
    base_ref: str
    base_folder: Path
    expert_refs: dict[str, str]
    experts: dict[str, Checkpoint]
    base: Checkpoint
    merge_params: dict[str, Any]

    @cached_property
    def vision_config(self):
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig.from_pretrained(str(self.base_folder))


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
        "tasks_table": {t.name: t.to_dict() for t in inputs.tasks},
        "seed": spec.seed,
        "merge": {
            "method": spec.merge_method,
            "params": inputs.merge_params,
            "from": spec.ta_model_path if spec.skip_ta else None,
        },
        "featcal": featcal,
        "evaluation": {"max_eval_samples": spec.max_eval_samples},
    }


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` stands for (``auto``: CUDA when torch sees a GPU, else the CPU).

    Raises:
        InvalidParameterError: for a name that is not a device, or CUDA where torch sees no GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidParameterError("device", name, "auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", name, "cpu or auto, since torch sees no GPU")
    return device


def expert_ref(task: Task, pattern: str | None, table_pattern: str | None) -> str:
    """Where task's expert comes from: ``expert_model_format``, else the task's entry, else the table's pattern."""
    if pattern is not None:
        if "{task}" not in pattern:
            raise InvalidParameterError("expert_model_format", pattern, "a pattern containing '{task}'")
        return pattern.format(task=task.name)
    if task.expert:
        return task.expert
    if table_pattern:
        return table_pattern.format(task=task.name)
    raise InvalidParameterError(
        "expert_model_format", None, f"a pattern with '{{task}}', since task {task.name!r} has no 'expert' entry"
    )


def resolve_inputs(spec: RunSpec, *, need_experts: bool = True) -> RunInputs:
    """Tasks, base and experts of a run, validated before anything is written."""
    table = task_table(spec.tasks_file)
    names = spec.tasks or (list(task_table(spec.tasks_file, replace=True).tasks) if spec.tasks_file else None)
    tasks = table.select(names)
    base_ref = spec.base_model_id or table.base_model
    if not base_ref:
        raise InvalidParameterError("base_model_id", None, "a Hub id or folder, since the task table names none")
    local = Path(base_ref).expanduser()
    base_ref = str(local.resolve()) if local.exists() else base_ref
    base_folder = resolve_model_folder(base_ref, what="base model", cache_dir=spec.cache_dir)
    check_clip_model_folder(base_folder)
    base = Checkpoint(base_folder, name=f"base model {base_ref}")
    base.check_finite()
    refs: dict[str, str] = {}
    experts: dict[str, Checkpoint] = {}
    if need_experts:
        for task in tasks:
            refs[task.name] = expert_ref(task, spec.expert_model_format, table.expert_model_pattern)
            folder = resolve_model_folder(
                refs[task.name], what=f"expert for task {task.name!r}", cache_dir=spec.cache_dir
            )
            experts[task.name] = Checkpoint(folder, name=f"Expert for task {task.name!r} ({refs[task.name]})")
        check_compatible(base, experts)
        for expert in experts.values():
            expert.check_finite()
    method = get_method(spec.merge_method)
    return RunInputs(tasks, base_ref, base_folder, refs, experts, base, method.resolved_params(**spec.method_params()))


@dataclass
class DatasetFacts:
    """What validation learnt about the tasks' datasets: each split's identity, and the calibration
    images each task will use when its train split holds fewer than asked for."""

    fingerprints: dict[str, dict[str, str]]
    calibration_counts: dict[str, int]


def validate_datasets(
    tasks: list[Task],
    splits: tuple[str, ...] = ("train", "test"),
    *,
    calibration_examples: int | None = None,
    allow_fewer: bool = False,
) -> DatasetFacts:
    """Load each task's splits once, so a missing split or column, a label outside the task's
    classes (read from the label column alone), or a train split smaller than
    ``calibration_examples`` fails before anything is written.

    Raises:
        DatasetInputError: naming the task, the split and the fix.
    """
    fingerprints: dict[str, dict[str, str]] = {}
    fewer: dict[str, int] = {}
    for task in tasks:
        for split in splits:
            dataset = load_task_split(task, split)
            check_labels(task, dataset, split)
            fingerprints.setdefault(task.name, {})[split] = dataset_fingerprint(dataset)
            if split == "train" and calibration_examples is not None and len(dataset) < calibration_examples:
                if not allow_fewer:
                    raise DatasetInputError(
                        task.name,
                        task.dataset.path,
                        f"Task {task.name!r}: the train split of {task.dataset.path} has {len(dataset)} images, "
                        f"fewer than the {calibration_examples} calibration images asked for: lower "
                        "`num_calibration_examples`, or set `allow_fewer_calibration_examples` to use them all.",
                    )
                fewer[task.name] = len(dataset)
    return DatasetFacts(fingerprints, fewer)


def check_labels(task: Task, dataset, split: str) -> None:
    """Raise naming the task, split and label when a label lies outside ``[0, number of class names)``."""
    import pyarrow.compute as pc

    bounds = pc.min_max(dataset.data.column(task.dataset.label_column)).as_py()
    low, high = int(bounds["min"]), int(bounds["max"])
    if low < 0 or high >= len(task.classnames):
        bad = low if low < 0 else high
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the {split} split of {task.dataset.path} has label {bad}, but the task has "
            f"{len(task.classnames)} class names (labels 0 to {len(task.classnames) - 1}); fix 'classnames' in "
            "the tasks file or the dataset.",
        )


def check_finite(state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise naming the first non-finite tensor of a result computed from finite inputs."""
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FeatcalError(f"{what}: tensor {key!r} is not finite, although every input is.")


def merge(inputs: RunInputs, method: str) -> dict[str, torch.Tensor]:
    """The merged vision tower's state dict."""
    merged = get_method(method)(inputs.base, [inputs.experts[t.name] for t in inputs.tasks], **inputs.merge_params)
    check_finite(merged, f"The {method} merge")
    return merged


def build_vision_model(inputs: RunInputs, state: Mapping[str, torch.Tensor]):
    """A `CLIPVisionModel` of the base's configuration holding ``state``."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel(inputs.vision_config)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def load_vision_folder(path: str | Path, base: Checkpoint | None = None):
    """A `CLIPVisionModel` from a folder (safetensors only), in float32, its tensors checked.

    Args:
        path: A `CLIPVisionModel` (or `CLIPModel`) folder.
        base: When given, the model must have the base's vision architecture.

    Raises:
        ModelInputError: for a folder without config or safetensors weights, a tensor that is not
            finite (naming file and tensor), or an architecture other than the base's.
    """
    from transformers import CLIPVisionModel

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelInputError(
            str(folder),
            f"{folder} is not a model folder (no config.json); "
            "pass a folder written by `featcal merge` or `save_pretrained`.",
        )
    checkpoint = Checkpoint(folder)  # raises a clear error for missing or pickle-only weights
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
    return CLIPVisionModel.from_pretrained(str(folder), use_safetensors=True, dtype=torch.float32).eval()


def calibrate(
    inputs: RunInputs,
    merged_model,
    params: FeatCalParams,
    *,
    seed: int,
    device: torch.device,
    processor,
    progress: bool = True,
):
    """The FeatCal-calibrated copy of ``merged_model``."""
    by_name = {t.name: t for t in inputs.tasks}
    model = featcal_calibrate(
        merged_model,
        inputs.base,
        inputs.experts,
        lambda name: calibration_pixels(by_name[name], processor, params.num_calibration_examples, seed),
        params,
        device=device,
        progress=progress,
    )
    check_finite(model.state_dict(), "FeatCal")
    return model


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
    calibrate_id = digest(
        "calibrate", __version__, calibrate_from, spec.featcal.to_dict(), spec.seed, base, experts, trains,
        data.calibration_counts,
    )  # fmt: skip
    stages += [
        Stage("calibrate", calibrate_id, [calibrated]),
        Stage(
            f"evaluate:{calibrated}",
            digest(evaluation, calibrate_id),
            [f"{calibrated}/{METRICS}", f"{calibrated}/{RUN_LOG}"],
        ),
    ]
    return {stage.name: stage for stage in stages}


def check_output_folder(out: Path) -> None:
    """Refuse an output path that is a file, or a folder that holds other things than a featcal run.

    Raises:
        InvalidParameterError: naming ``output_dir``.
    """
    if out.exists() and not out.is_dir():
        raise InvalidParameterError("output_dir", str(out), "a folder, not an existing file")
    if out.is_dir() and not (out / RUN_CONFIG).is_file():
        visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if visible:
            raise InvalidParameterError(
                "output_dir",
                str(out),
                f"a new or empty folder, or a featcal run folder; it holds {', '.join(visible[:3])}",
            )


def check_same_run(out: Path, record: Mapping[str, Any]) -> None:
    """Refuse a run folder that holds a run of other tasks or another base model.

    Raises:
        RunFolderError: naming the folder and the differences; ``force`` replaces it instead.
    """
    path = out / RUN_CONFIG
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        old = {}
    differs = [key for key in ("tasks", "base_model_id") if not isinstance(old, dict) or old.get(key) != record[key]]
    if differs:
        raise RunFolderError(
            out,
            f"The run folder {out} holds a run with another {' and '.join(differs)}: use another output folder, "
            "or set `force` to replace that run.",
        )


def run_pipeline(spec: RunSpec) -> dict[str, MetricsReport]:
    """Run every stage ``spec`` asks for, writing the run folder ``spec.output_dir``.

    Everything is validated first: options, models, datasets, the output folder. Then the folder is
    locked, leftovers of a killed run are removed, and each stage runs unless the folder already
    holds its result from the same inputs (``stages.json`` records them); a stage whose inputs
    changed is redone with everything after it. ``spec.force`` redoes every stage.

    Args:
        spec: The run's options (see :class:`~featcal.spec.RunSpec`).

    Returns:
        The evaluation report of each evaluated stage, by stage folder name (``zero-shot``,
        ``experts``, ``ta``, ``featcal-ta``, …).

    Raises:
        FeatcalError: for any input that cannot be used (typed subclasses name it), raised before
            any file is written whenever the problem can be seen up front; ``RunLockedError`` when
            another process is writing the folder.
    """
    device = resolve_device(spec.device)
    out = Path(spec.output_dir)
    check_output_folder(out)
    torch.manual_seed(spec.seed)
    inputs = resolve_inputs(spec, need_experts=not (spec.skip_ta and spec.skip_featcal and not spec.eval_experts))
    data = validate_datasets(
        inputs.tasks,
        ("test",) if spec.skip_featcal else ("train", "test"),
        calibration_examples=None if spec.skip_featcal else spec.featcal.num_calibration_examples,
        allow_fewer=spec.allow_fewer_calibration_examples,
    )
    record = run_record(spec, inputs, data.calibration_counts)
    if not spec.force:
        check_same_run(out, record)
    clip, tokenizer, processor = load_base_clip(inputs.base_folder, device)
    if spec.skip_ta:
        load_vision_folder(spec.ta_model_path, inputs.base)  # checked before the folder is touched
    stages = plan_stages(spec, inputs, data)
    created = not out.exists()
    try:
        with RunLock(out):
            run = _Run(spec, out, inputs, stages, device, ZeroShotClassifier(clip, tokenizer, device), processor)
            return run.execute(record, clip)
    except BaseException:
        if created and not (out / STAGES_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)  # nothing finished: leave no half-made folder
        raise


class _Run:
    """The stages of one locked run over a run folder, skipping those already done."""

    def __init__(self, spec, out, inputs, stages, device, classifier, processor) -> None:
        self.spec, self.out, self.inputs, self.stages = spec, out, inputs, stages
        self.device, self.classifier, self.processor = device, classifier, processor
        self.ledger = StageLedger(out) if spec.force else StageLedger.read(out)
        self.run_id = ""
        self.timings: dict[str, float] = {}
        self.eval_kwargs = dict(
            batch_size=spec.eval_batch_size,
            num_workers=spec.eval_num_workers,
            max_samples=spec.max_eval_samples,
            progress=spec.progress,
        )

    def execute(self, record: Mapping[str, Any], clip) -> dict[str, MetricsReport]:
        spec, out, inputs = self.spec, self.out, self.inputs
        remove_leftovers(out)
        self.run_id = config_hash(record)
        if spec.force:
            self._clear_unrecorded()
        self._clear_stale()
        write_run_config(out, record)
        fault_point("after:run_config")
        if (out / TIMINGS).is_file() and self.ledger.done:
            self.timings = {k: float(v) for k, v in read_json(out / TIMINGS).items()}
        merged_name = merged_stage_name(spec.merge_method)
        calibrated_name = calibrated_stage_name(spec.merge_method)
        results: dict[str, MetricsReport] = {}
        if spec.eval_zero_shot:
            results[ZERO_SHOT_DIR] = self._evaluate(ZERO_SHOT_DIR, lambda: clip.vision_model)
        if spec.eval_experts:
            results[EXPERTS_DIR] = self._evaluate_experts()

        merged_model = None
        if spec.skip_ta:
            merged_model = load_vision_folder(spec.ta_model_path, inputs.base)
        elif self._fresh("merge"):
            logger.info("Merge: %s/ is up to date (same inputs); skipped", merged_name)
        else:
            start = time.perf_counter()
            state = merge(inputs, spec.merge_method)
            save_vision_model(state, inputs.vision_config, out / merged_name)
            self.timings["merge_s"] = time.perf_counter() - start
            merged_model = build_vision_model(inputs, state)
            self._mark("merge")

        def merged() -> Any:
            nonlocal merged_model
            if merged_model is None:
                merged_model = load_vision_folder(out / merged_name, inputs.base)
            return merged_model

        if not spec.skip_eval_ta:
            if spec.skip_ta:  # the merged model comes from elsewhere: reported, not written
                start = time.perf_counter()
                results[merged_name] = self.classifier.evaluate(
                    merged(), inputs.tasks, self.processor, **self.eval_kwargs
                )
                self.timings[f"eval_{merged_name}_s"] = time.perf_counter() - start
            else:
                results[merged_name] = self._evaluate(merged_name, merged)

        if not spec.skip_featcal:
            calibrated_model = None
            if self._fresh("calibrate"):
                logger.info("FeatCal: %s/ is up to date (same inputs); skipped", calibrated_name)
            else:
                start = time.perf_counter()
                calibrated_model = calibrate(
                    inputs, merged(), spec.featcal, seed=spec.seed, device=self.device,
                    processor=self.processor, progress=spec.progress,
                )  # fmt: skip
                self.timings["calibrate_s"] = time.perf_counter() - start
                save_vision_model(calibrated_model.state_dict(), inputs.vision_config, out / calibrated_name)
                self._mark("calibrate")
            results[calibrated_name] = self._evaluate(
                calibrated_name,
                lambda: (
                    calibrated_model
                    if calibrated_model is not None
                    else load_vision_folder(out / calibrated_name, inputs.base)
                ),
                extra={"calibration_examples_used": record["featcal"].get("calibration_examples_used")},
            )
        write_timings(out, self.timings)
        if not spec.no_export and (not spec.skip_featcal or not (spec.skip_ta or spec.skip_eval_ta)):
            self._export()
        return results

    def _fresh(self, name: str) -> bool:
        return self.ledger.is_done(name, self.stages[name].identity)

    def _mark(self, name: str) -> None:
        self.ledger.mark(name, self.stages[name].identity, self.stages[name].outputs)
        fault_point(f"after:{name}")

    def _clear_stale(self) -> None:
        """Remove outputs whose inputs changed, of stages this run cannot produce, and any release
        that is not of exactly this run; a run folder without a ledger is redone whole."""
        if not self.ledger.done and (self.out / RUN_CONFIG).is_file():
            self._clear_unrecorded()
        for name in [n for n in self.ledger.done if n != "export"]:
            if name not in self.stages or not self._fresh(name):
                logger.info("%s: inputs changed; its earlier output is removed and redone", name)
                self.ledger.discard(name)
        export = self.ledger.done.get("export")
        if export is not None and export.get("identity") != self._export_identity():
            self.ledger.discard("export")

    def _clear_unrecorded(self) -> None:
        """Stage folders of an earlier run that recorded no ledger (or was forced): all redone."""
        old = read_json(self.out / RUN_CONFIG)
        methods = {self.spec.merge_method, (old.get("merge") or {}).get("method", self.spec.merge_method)}
        names = {ZERO_SHOT_DIR, EXPERTS_DIR, RELEASE_DIR}
        names |= {merged_stage_name(m) for m in methods} | {calibrated_stage_name(m) for m in methods}
        for name in sorted(names):
            if (self.out / name).is_dir():
                shutil.rmtree(self.out / name)
        (self.out / TIMINGS).unlink(missing_ok=True)

    def _evaluate(self, folder: str, model: Any, extra: Mapping[str, Any] | None = None) -> MetricsReport:
        name = f"evaluate:{folder}"
        if self._fresh(name):
            logger.info("Evaluation of %s/ is up to date (same inputs); skipped", folder)
            return restamp_report(self.out / folder, self.run_id)
        start = time.perf_counter()
        report = self.classifier.evaluate(model(), self.inputs.tasks, self.processor, **self.eval_kwargs)
        report = report.with_extra({k: v for k, v in (extra or {}).items() if v})
        self.timings[f"eval_{folder}_s"] = time.perf_counter() - start
        write_stage_report(self.out / folder, report, self.run_id)
        self._mark(name)
        return report

    def _evaluate_experts(self) -> MetricsReport:
        name = f"evaluate:{EXPERTS_DIR}"
        if self._fresh(name):
            logger.info("Evaluation of the experts is up to date (same inputs); skipped")
            return restamp_report(self.out / EXPERTS_DIR, self.run_id)
        per_task = {
            task.name: self.classifier.evaluate_task(
                build_vision_model(self.inputs, self.inputs.experts[task.name]), task, self.processor,
                **self.eval_kwargs,
            )
            for task in self.inputs.tasks
        }  # fmt: skip
        report = MetricsReport.from_results(per_task)
        write_stage_report(self.out / EXPERTS_DIR, report, self.run_id)
        self._mark(name)
        return report

    def _export_identity(self) -> str:
        return digest("export", __version__, self.run_id, sorted(
            (name, entry.get("identity")) for name, entry in self.ledger.done.items() if name != "export"
        ))  # fmt: skip

    def _export(self) -> None:
        from featcal.release import export_release

        identity = self._export_identity()
        if self.ledger.is_done("export", identity) and (self.out / RELEASE_DIR).is_dir():
            logger.info("Release: %s/ is up to date; skipped", RELEASE_DIR)
            return
        export_release(self.out)
        self.ledger.mark("export", identity, [RELEASE_DIR])
        fault_point("after:export")
