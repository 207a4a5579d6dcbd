"""`featcal run` (the whole pipeline) and the single stages `merge`, `calibrate`, `evaluate`, `methods`.

Flags come from :mod:`featcal.spec` through :mod:`featcal.cli.options`; the library is imported only
inside the command that needs it, so ``featcal --help`` does not import torch. Under torchrun each
command runs in every process (:func:`featcal.distributed.session`); rank 0 alone writes and prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.calibration.params import GROUP as FEATCAL
from featcal.cli.common import format_results, path_line, show_progress
from featcal.cli.options import add_options, add_spec_options, command, given_values
from featcal.cli.suites import SuiteChoice
from featcal.repairs.options import DEFAULT_REPAIR, MODULE_REPAIRS, RepairChoice, RepairComparison
from featcal.spec import EVALUATION, MERGING, RUNTIME, TASKS, RunSpec, build_spec, load_recipe

if TYPE_CHECKING:
    from featcal.distributed import World
    from featcal.repairs.registry import Repair


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The run spec: defaults, then the ``--recipe`` file, then the flags the user typed."""
    recipe = load_recipe(args.recipe) if getattr(args, "recipe", None) else None
    return build_spec(
        cli=given_values(args), recipe=recipe, recipe_source=getattr(args, "recipe", None), progress=show_progress(args)
    )


@contextmanager
def compute_settings(spec: RunSpec, inputs) -> Iterator[None]:
    """The command's CUDA precision and torch threads (``--precision``, ``--threads``), restored after."""
    from featcal.precision import fixed_precision
    from featcal.threads import choose_threads, torch_threads

    threads = choose_threads(spec.threads, inputs.family.hidden_size(inputs.config))
    with fixed_precision(spec.precision), torch_threads(threads):
        yield


def cmd_run(args: argparse.Namespace) -> int:
    from featcal.distributed import session
    from featcal.pipeline import run_pipeline
    from featcal.runfolder.layout import RELEASE_DIR

    spec = spec_from_args(args)
    repairs = RepairComparison(**given_values(args, RepairComparison)).repair
    with session(spec.device, spec.dist_timeout) as world:
        if repairs:  # featcal run --repair: the repairs side by side on the run's merge
            from featcal.repairs.compare_run import run_compared

            results, _ = run_compared(spec, repairs, world)
        else:
            results = run_pipeline(spec, world)
    if not world.is_main:
        return 0
    if results:
        print(format_results(results))
    if repairs:
        from featcal.repairs.compare_table import comparison_text

        print(comparison_text(spec.output_dir))
    out = Path(spec.output_dir)
    print(path_line("Run folder", out))
    if not spec.no_export and (out / RELEASE_DIR).is_dir():
        print(path_line("Release folder", out / RELEASE_DIR))
    return 0


def _metrics_output(output: str | None, model: str | None) -> Path | None:
    """Where `featcal evaluate` writes its metrics, checked: ``--output``, else the model folder's
    ``metrics.json``, which is refused where it is a run's or a release's own record."""
    from featcal.errors import OutputPathError
    from featcal.outputs import check_output_file
    from featcal.release.manifest import MANIFEST
    from featcal.runfolder.layout import METRICS, RUN_CONFIG

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


# The options of `featcal merge` that say which calibration examples a data-using method reads.
MERGE_DATA_OPTIONS = ("num_calibration_examples", "calibration_batch_size", "allow_fewer_calibration_examples", "seed")


def check_merge_data_options(args: argparse.Namespace, spec: RunSpec) -> bool:
    """Whether the spec's merging method merges from calibration data; calibration options given to one that
    does not are refused, since they would change nothing.

    Raises:
        InvalidParameterError: naming the first such option and the methods that read it.
        UnknownNameError: when no merging method has that name.
    """
    from featcal.errors import InvalidParameterError
    from featcal.merging import available_methods, get_method

    method = spec.merge_method
    if get_method(method).uses_data:
        return True
    given = [name for name in MERGE_DATA_OPTIONS if name in given_values(args)]
    if given:
        readers = [name for name in available_methods() if get_method(name).uses_data]
        owner = spec.featcal if hasattr(spec.featcal, given[0]) else spec
        raise InvalidParameterError(
            given[0], getattr(owner, given[0]), f"given only with a merging method that uses calibration data "
            f"({', '.join(readers)}): {method} uses none",
        )  # fmt: skip
    return False


def cmd_merge(args: argparse.Namespace) -> int:
    from featcal.data import validate_datasets
    from featcal.distributed import session
    from featcal.merging.data import check_data_family
    from featcal.outputs import check_output_folder
    from featcal.resolve import resolve_inputs
    from featcal.runfolder.lock import OutputLock
    from featcal.stages import check_calibration_shares, merge, merge_calibration, merge_data, save_merge

    spec = spec_from_args(args)
    uses_data = check_merge_data_options(args, spec)
    output = check_output_folder(args.output, kind="merged model")  # before any download
    calibration, data = None, None
    with session(spec.device, spec.dist_timeout) as world, ExitStack() as held:
        device = world.compute_device(spec.device)
        with world.main_first("checking the inputs"):
            inputs = resolve_inputs(spec)
            if world.is_main:  # one writer of the folder until it is written (released after the save)
                held.enter_context(OutputLock(output, kind="merged model"))
            check_output_folder(output, kind="merged model", inputs=inputs.local_folders())
            if uses_data:  # each task's calibration examples, read before the merge starts
                family, params = inputs.family, spec.featcal
                check_data_family(spec.merge_method, family)
                preprocessor = family.preprocessor(inputs.base_folder)
                facts = validate_datasets(
                    family, inputs.tasks, splits=("train",), calibration_examples=params.num_calibration_examples,
                    allow_fewer=spec.allow_fewer_calibration_examples, seed=spec.seed, preprocessor=preprocessor,
                )  # fmt: skip
                counts = facts.calibration_counts
                check_calibration_shares(inputs.tasks, counts, params.num_calibration_examples, world, family.noun)
                calibration = merge_calibration(params, spec.seed, counts, facts.fingerprints, inputs.tasks)
                data = merge_data(inputs, preprocessor, params, spec.seed, world=world, progress=spec.progress)
        with compute_settings(spec, inputs):
            state = merge(inputs, spec.merge_method, device, world=world, data=data, output_dtype=spec.output_dtype)
        if not world.is_main:
            return 0
        folder = save_merge(inputs, spec.merge_method, state, output, calibration, output_dtype=spec.output_dtype)
    print(path_line(f"Merged model ({spec.merge_method}, {len(inputs.tasks)} experts)", folder))
    return 0


# The run options a data-free repair (`featcal calibrate --method svc`) takes: where to compute and write.
DATA_FREE_OPTIONS = ("cache_dir", "device", "precision", "threads", "dist_timeout", "output_dtype")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from featcal.data import validate_datasets
    from featcal.distributed import session
    from featcal.errors import InvalidParameterError
    from featcal.outputs import check_output_folder
    from featcal.repairs.catalog import get_repair
    from featcal.resolve import resolve_inputs
    from featcal.runfolder.lock import OutputLock
    from featcal.stages import calibrate

    choice = RepairChoice(**given_values(args, RepairChoice))
    repair = get_repair(choice.method)
    if choice.evaluate and repair.name not in MODULE_REPAIRS:
        raise InvalidParameterError(
            "evaluate", True, f"given only with --method {' or '.join(MODULE_REPAIRS)}, whose result is no model "
            "folder: evaluate a repaired model folder with `featcal evaluate --model DIR`",
        )  # fmt: skip
    if not repair.uses_data:
        return repair_folder(args, repair, choice.repair_params)
    if repair.name in MODULE_REPAIRS:
        return surgery_folder(args, repair, choice.repair_params, evaluate=choice.evaluate)
    if repair.name != DEFAULT_REPAIR:
        return lot_folder(args, repair, choice.repair_params)
    if choice.repair_params:
        given = " ".join(f"{key}={value}" for key, value in choice.repair_params.items())
        raise InvalidParameterError(
            "repair_params", given, f"given only with a repair other than {repair.name}, whose "
            "parameters have flags of their own (--lambda-ratio, ...: `featcal calibrate --help`)",
        )  # fmt: skip
    spec = spec_from_args(args)
    output = check_output_folder(args.output, kind="calibrated model", inputs=[args.merged])  # before any download
    with session(spec.device, spec.dist_timeout) as world, ExitStack() as held:
        device = world.compute_device(spec.device)
        with world.main_first("checking the inputs"):
            inputs = resolve_inputs(spec, merged=args.merged)
            family = inputs.family
            if world.is_main:  # one writer of the folder until it is written
                held.enter_context(OutputLock(output, kind="calibrated model"))
            check_output_folder(output, kind="calibrated model", inputs=[*inputs.local_folders(), args.merged])
            preprocessor = family.preprocessor(inputs.base_folder)
            data = validate_datasets(
                family,
                inputs.tasks,
                splits=("train",),
                calibration_examples=spec.featcal.num_calibration_examples,
                allow_fewer=spec.allow_fewer_calibration_examples,
                seed=spec.seed,
                preprocessor=preprocessor,
            )
            family.check_model_folder(Path(args.merged), inputs.base)
        with compute_settings(spec, inputs):
            calibrate(
                inputs, args.merged, output if world.is_main else None, spec.featcal, seed=spec.seed,
                device=device, preprocessor=preprocessor, progress=spec.progress, world=world,
                precision=spec.precision, counts=data.calibration_counts, output_dtype=spec.output_dtype,
                stream_storage=spec.stream_storage,
            )  # fmt: skip
    if not world.is_main:
        return 0
    print(path_line("Calibrated model", output))
    return 0


@contextmanager
def one_process(spec: RunSpec, repair: Repair) -> Iterator[World]:
    """The session of a repair that runs in one process (all but FeatCal).

    Raises:
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.distributed import session
    from featcal.errors import FeatcalError

    with session(spec.device, spec.dist_timeout) as world:
        if world.distributed:
            raise FeatcalError(
                f"featcal calibrate --method {repair.name} runs in one process: start it without torchrun."
            )
        yield world


def repair_folder(args: argparse.Namespace, repair: Repair, params: dict[str, Any]) -> int:
    """`featcal calibrate --method NAME` for a data-free, weight-only repair (SVC): the base and experts the
    merged folder records, no tasks nor data (a task or calibration option given is refused), one process.

    Raises:
        InvalidParameterError: for an option it does not read, or a bad hyper-parameter.
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.errors import InvalidParameterError
    from featcal.outputs import check_output_folder
    from featcal.repairs.apply import recorded_inputs, repair_state, save_repair
    from featcal.resolve import check_output_dtype

    values = given_values(args)
    given = [name for name in values if name not in DATA_FREE_OPTIONS]
    if given:
        raise InvalidParameterError(
            given[0], values[given[0]], "given only with a repair that reads tasks or calibration data (featcal): "
            f"{repair.name} is data-free and reads the base and experts its --merged folder records",
        )  # fmt: skip
    resolved = repair.resolved_params(**params)
    spec = spec_from_args(args)
    output = check_output_folder(args.output, kind="repaired model", inputs=[args.merged])  # before any download
    with one_process(spec, repair) as world:
        inputs = recorded_inputs(args.merged, repair, cache_dir=spec.cache_dir)
        check_output_dtype(inputs.family, spec.output_dtype)
        check_output_folder(output, kind="repaired model", inputs=[*inputs.local_folders(), args.merged])
        merged = inputs.family.check_model_folder(Path(args.merged), inputs.base)
        experts = [inputs.experts[name] for name in inputs.expert_refs]
        with compute_settings(spec, inputs):
            state = repair_state(
                repair, resolved, inputs.base, experts, merged, device=world.compute_device(spec.device),
                output_dtype=spec.output_dtype,
            )  # fmt: skip
    folder = save_repair(inputs, args.merged, repair, resolved, state, output, output_dtype=spec.output_dtype)
    print(path_line(f"Repaired model ({repair.name})", folder))
    return 0


# FeatCal's own parameters, which a data-using repair other than FeatCal does not read (it reads its draw).
CALIBRATION_DRAW = ("num_calibration_examples", "calibration_batch_size")


def refuse_featcal_parameters(args: argparse.Namespace, repair: Repair) -> None:
    """Refuse a FeatCal parameter given to a data-using repair other than FeatCal, which reads FeatCal's
    calibration draw (``--num-calibration-examples``, ``--seed``) and none of its parameters.

    Raises:
        InvalidParameterError: naming the first such parameter and its value.
    """
    from featcal.calibration.params import FeatCalParams
    from featcal.errors import InvalidParameterError

    values = given_values(args)
    featcal_only = [n for n in values if n in FeatCalParams.__dataclass_fields__ and n not in CALIBRATION_DRAW]
    if featcal_only:
        raise InvalidParameterError(
            featcal_only[0], values[featcal_only[0]], f"given only with --method featcal: {repair.name} reads "
            "FeatCal's calibration draw (--num-calibration-examples, --seed) but none of its parameters",
        )  # fmt: skip


def lot_folder(args: argparse.Namespace, repair: Repair, params: dict[str, Any]) -> int:
    """`featcal calibrate --method lot`: the tasks (``--data``, ``--tasks-file``, ...) and FeatCal's calibration
    draw of them (``-n``, ``--seed``), the base and the experts, the merge in ``--merged``; one process.

    Raises:
        InvalidParameterError: for a FeatCal parameter, a bad hyper-parameter, or a family it is not defined for.
        ModelInputError: for a folder calibrated already, or a model that does not fit.
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.data import validate_datasets
    from featcal.outputs import check_output_folder
    from featcal.repairs.apply import check_uncalibrated, save_repair
    from featcal.repairs.lot import check_lot_family, lot_state
    from featcal.resolve import resolve_inputs
    from featcal.stages import merge_calibration, merge_data

    refuse_featcal_parameters(args, repair)
    resolved = repair.resolved_params(**params)
    spec = spec_from_args(args)
    output = check_output_folder(args.output, kind="repaired model", inputs=[args.merged])  # before any download
    with one_process(spec, repair) as world:
        check_uncalibrated(args.merged, repair)
        inputs = resolve_inputs(spec, merged=args.merged)
        family = inputs.family
        check_lot_family(family)
        check_output_folder(output, kind="repaired model", inputs=[*inputs.local_folders(), args.merged])
        preprocessor = family.preprocessor(inputs.base_folder)
        facts = validate_datasets(
            family, inputs.tasks, splits=("train",), calibration_examples=spec.featcal.num_calibration_examples,
            allow_fewer=spec.allow_fewer_calibration_examples, seed=spec.seed, preprocessor=preprocessor,
        )  # fmt: skip
        merged = family.check_model_folder(Path(args.merged), inputs.base)
        draw = merge_calibration(spec.featcal, spec.seed, facts.calibration_counts, facts.fingerprints, inputs.tasks)
        data = merge_data(inputs, preprocessor, spec.featcal, spec.seed, world=world, progress=spec.progress)
        experts = [inputs.experts[t.name] for t in inputs.tasks]
        with compute_settings(spec, inputs):
            state = lot_state(inputs.base, experts, merged, data, world.compute_device(spec.device), world)
    recorded = {**resolved, "calibration": draw}
    folder = save_repair(inputs, args.merged, repair, recorded, state, output, output_dtype=spec.output_dtype)
    print(path_line(f"Repaired model ({repair.name}, {len(inputs.tasks)} tasks)", folder))
    return 0


def surgery_folder(args: argparse.Namespace, repair: Repair, params: dict[str, Any], *, evaluate: bool) -> int:
    """Train each task's module (Representation Surgery or ProbSurgery) on FeatCal's calibration draw (``-n``,
    ``--seed``) of the tasks, write the modules, recipe and report to ``--output``, and evaluate them with
    ``--evaluate``; one process.

    Raises:
        InvalidParameterError: for a FeatCal parameter, a bad hyper-parameter, or a family other than CLIP.
        ModelInputError: for a folder calibrated already, or a model that does not fit.
        DatasetInputError: for a task without a train split (or, with ``--evaluate``, a test split).
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.data import validate_datasets
    from featcal.outputs import check_output_folder
    from featcal.repairs.apply import check_uncalibrated
    from featcal.repairs.surgery import check_surgery_family
    from featcal.repairs.surgery_run import evaluate_surgery, run_surgery, save_surgery
    from featcal.resolve import resolve_inputs
    from featcal.stages import merge_calibration

    refuse_featcal_parameters(args, repair)
    resolved = repair.resolved_params(**params)
    spec = spec_from_args(args)
    output = check_output_folder(args.output, kind="repair output", inputs=[args.merged])  # before any download
    with one_process(spec, repair) as world:
        check_uncalibrated(args.merged, repair)
        inputs = resolve_inputs(spec, merged=args.merged)
        family = inputs.family
        check_surgery_family(family, repair)
        check_output_folder(output, kind="repair output", inputs=[*inputs.local_folders(), args.merged])
        preprocessor = family.preprocessor(inputs.base_folder)
        n, seed = spec.featcal.num_calibration_examples, spec.seed
        facts = validate_datasets(
            family, inputs.tasks, splits=("train", "test") if evaluate else ("train",), calibration_examples=n,
            allow_fewer=spec.allow_fewer_calibration_examples, seed=seed, preprocessor=preprocessor,
        )  # fmt: skip
        family.check_model_folder(Path(args.merged), inputs.base)
        draw = merge_calibration(spec.featcal, seed, facts.calibration_counts, facts.fingerprints, inputs.tasks)
        device = world.compute_device(spec.device)
        evaluator = family.evaluator(inputs.base_folder, device, world=world, settings=family.evaluation_settings(spec))
        with compute_settings(spec, inputs):
            merged = family.load_model(Path(args.merged), inputs.base)
            batches = {t.name: family.calibration_inputs(t, preprocessor, n, seed, world=world) for t in inputs.tasks}
            pixels = {name: _only_input(batch.inputs) for name, batch in batches.items()}
            result, cost = run_surgery(
                evaluator.classifier, merged, lambda name: family.build_model(inputs.config, inputs.experts[name]),
                pixels, resolved, seed=seed,
                batch_size=spec.featcal.calibration_batch_size, repair=repair,
            )  # fmt: skip
            report: dict[str, Any] = {**cost, "loss_first_step": result.losses[0], "loss_last_step": result.losses[-1]}
            if evaluate:
                evaluator.prepare(inputs.tasks)
                images = evaluator.test_data(
                    inputs.tasks, batch_size=spec.eval_batch_size, num_workers=spec.eval_num_workers,
                    max_samples=spec.max_eval_samples,
                )  # fmt: skip
                report["accuracy"] = evaluate_surgery(
                    evaluator.classifier, merged, result.modules, inputs.tasks, images, repair
                )
    folder = save_surgery(inputs, args.merged, {**resolved, "calibration": draw}, result, report, output, repair)
    print(path_line(f"{repair.pretty_name} modules ({len(inputs.tasks)} tasks)", folder))
    if evaluate:
        for task, acc in report["accuracy"].items():
            print(f"{task}: accuracy {acc['accuracy']:.4f} (merge alone {acc['accuracy_without']:.4f})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from featcal.data import validate_datasets
    from featcal.distributed import session
    from featcal.files.atomic import atomic_write_json
    from featcal.metrics import WEIGHTS_SHA256, weights_sha256
    from featcal.outputs import check_metrics_output
    from featcal.resolve import resolve_inputs
    from featcal.runfolder.layout import ZERO_SHOT_DIR
    from featcal.runfolder.lock import RunLock

    spec = spec_from_args(args)
    output = _metrics_output(args.output, args.model)
    run = None
    with session(spec.device, spec.dist_timeout) as world:
        device = world.compute_device(spec.device)
        with world.main_first("checking the inputs"):
            inputs = resolve_inputs(spec, need_experts=False, model=args.model)
            family = inputs.family
            if args.output is not None:  # the model folder's own metrics.json is checked by _metrics_output
                datasets = [t.dataset.path for t in inputs.tasks]
                files = [spec.tasks_file] if spec.tasks_file else []
                run = check_metrics_output(
                    output, inputs=[*inputs.local_folders(), *files, *datasets, *([args.model] if args.model else [])]
                )  # fmt: skip
            validate_datasets(
                family, inputs.tasks, splits=("test",), held_out_after=spec.featcal.num_calibration_examples
            )
            evaluator = family.evaluator(
                inputs.base_folder, device, world=world, settings=family.evaluation_settings(spec, inputs.tasks)
            )
            model = family.load_model(Path(args.model), inputs.base) if args.model else evaluator.base_model()
        with compute_settings(spec, inputs):
            data = evaluator.test_data(
                inputs.tasks,
                batch_size=spec.eval_batch_size,
                num_workers=spec.eval_num_workers,
                max_samples=spec.max_eval_samples,
            )
            report = evaluator.evaluate(model, inputs.tasks, data=data, progress=spec.progress)
    if args.model:  # the report is the record of these weights
        report = report.with_extra({WEIGHTS_SHA256: weights_sha256(Path(args.model))})
    if not world.is_main:
        return 0
    if output:
        with RunLock(run) if run is not None else nullcontext():  # a run's evaluations/ under its lock
            atomic_write_json(output, report.to_json())
    print(format_results({Path(args.model).name if args.model else ZERO_SHOT_DIR: report}))
    if output:
        print(path_line("Metrics", output))
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from featcal.merging import available_methods, get_method
    from featcal.runfolder.layout import merged_stage_name
    from featcal.suites import merged_reference, reference_source

    choice = SuiteChoice(**given_values(args, SuiteChoice))
    suite, backbone = choice.suite, choice.backbone
    published = merged_reference(suite, backbone)
    for name in available_methods():
        method = get_method(name)
        print(f"{name:<18} {method.pretty_name}  {method.reference_url}  → folder {merged_stage_name(name)}/")
        data = [DATA_LINE] if method.uses_data else []
        for line in [method.description, *data, *map(str, method.params)]:
            print(f"{'':<18} {line}")
        for key in (name, f"{name}_featcal"):
            if "average" in published.get(key, {}):
                label = "published average" + (" with FeatCal" if key != name else "")
                print(f"{'':<18} {label} on {suite}/{backbone}: {100 * published[key]['average']:.2f}")
    if published:
        print(f"Published averages: {reference_source(suite, backbone)}; per task: `featcal tasks`.")
    else:
        print(f"No merge accuracy is published for {suite} on {backbone}.")
    print_repairs()
    return 0


def print_repairs() -> None:
    """`featcal methods`' second part: the post-merge repairs, what each needs and whether its result is released."""
    from featcal.repairs.catalog import available_repairs, get_repair

    print("\nPost-merge repairs (`featcal calibrate --method NAME --merged DIR`; docs/repairs.md):")
    for name in available_repairs():
        repair = get_repair(name)
        data = "yes (each task's train examples)" if repair.uses_data else "no (data-free: weights only)"
        release = "yes (a plain transformers model)" if repair.releasable else "no (it adds modules to the model)"
        print(f"{name:<18} {repair.pretty_name}  {repair.reference_url}")
        for line in [
            repair.description,
            f"needs calibration data: {data}; releasable: {release}",
            *map(str, repair.params),
        ]:
            print(f"{'':<18} {line}")


DATA_LINE = (
    "uses calibration data: each task's first num-calibration-examples train examples after the seeded shuffle "
    "(FeatCal's draw)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `run`, `merge`, `calibrate`, `evaluate` and `methods`, each with ``func`` set to its handler."""
    p = subparsers.add_parser(
        "run",
        help="merge → evaluate → FeatCal → evaluate, into a run folder",
        description="The whole pipeline, with the FeatCal reference run's options.",
    )
    p.add_argument(
        "--recipe",
        metavar="FILE",
        help="YAML recipe: option names (without --) mapped to values; flags given here win",
    )
    add_spec_options(p)
    add_options(p, RepairComparison, section="post-merge repairs side by side (see `featcal methods`; docs/repairs.md)")
    command(p, cmd_run)

    p = subparsers.add_parser("merge", help="merge experts into one model folder")
    p.add_argument("--output", required=True, metavar="DIR", help="model folder to write")
    add_spec_options(p, groups=(TASKS, MERGING, RUNTIME), exclude=("seed",), renamed={"merge_method": "--method"})
    add_spec_options(
        p, only=MERGE_DATA_OPTIONS, section="calibration data (methods that use it: see `featcal methods`)",
        helps={"num_calibration_examples": "train examples per task the merge reads",
               "calibration_batch_size": "examples per forward batch while reading them"},
    )  # fmt: skip
    add_spec_options(p, only=("output_dtype",))
    command(p, cmd_merge)

    p = subparsers.add_parser(
        "calibrate",
        help="calibrate a merged model folder with FeatCal (or repair it: --method svc, lot, surgery, probsurgery)",
    )
    p.add_argument(
        "--merged",
        required=True,
        metavar="DIR",
        help="merged model folder: a CLIPVisionModel, a causal LM or a T5 model (featcal's merge or mergekit's output, "
        "whose records name the base and the experts)",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="model folder to write")
    add_options(p, RepairChoice, section="repair (see `featcal methods`; docs/repairs.md)")
    add_spec_options(p, groups=(TASKS, FEATCAL, RUNTIME))
    add_spec_options(p, only=("output_dtype",))
    command(p, cmd_calibrate)

    p = subparsers.add_parser(
        "evaluate",
        help="score a model folder on each task: a CLIP vision tower's zero-shot accuracy, a causal LM's held-out "
        "loss and exact match, a T5's exact match (or Spearman's ρ)",
        description="Evaluate one model folder, a CLIP vision tower (zero-shot accuracy), a causal LM (held-out "
        "loss and exact match) or a T5 (exact match or Spearman's ρ), on the tasks of a suite or a tasks file: a "
        "language model or a T5 needs a --tasks-file whose tasks name their family, and --base-model-id. A model "
        "of another family than the tasks' is refused in one line.",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder of the tasks' family: a CLIPVisionModel, a causal LM or a T5 (default: the base model)",
    )
    p.add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help="metrics JSON (default DIR/metrics.json; needed where DIR is a stage of a run or a release, whose "
        "metrics.json is their record; inside a run folder, only in RUN/evaluations/)",
    )
    add_spec_options(
        p, groups=(TASKS, EVALUATION, RUNTIME),
        exclude=("expert_model_format", "seed", "data", "eval_max_new_tokens", "lm_eval_tasks", "lm_eval_include"),
    )  # fmt: skip
    command(p, cmd_evaluate)

    p = subparsers.add_parser("methods", help="list the merging methods and the repairs, with their hyper-parameters")
    add_options(p, SuiteChoice, exclude=("json",), helps={"suite": "show the averages published for it",
                                                          "backbone": "… on this backbone"})  # fmt: skip
    command(p, cmd_methods)


def _only_input(inputs: dict[str, Any]) -> Any:
    """The one tensor an image family's calibration batch hands its stem (a CLIP tower's pixels)."""
    (tensor,) = inputs.values()
    return tensor
