"""`featcal run` (the whole pipeline) and the single stages `merge`, `calibrate`, `evaluate`, `methods`.

Flags come from :mod:`featcal.spec` through :mod:`featcal.cli.options`; the library is imported only
inside the command that needs it, so ``featcal --help`` does not import torch. Under torchrun each
command runs in every process (:func:`featcal.distributed.session`); rank 0 alone writes and prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.calibration.params import GROUP as FEATCAL
from featcal.cli.common import format_results, path_line, show_progress
from featcal.cli.options import add_options, add_spec_options, command, given_values
from featcal.cli.suites import SuiteChoice
from featcal.repairs.options import DEFAULT_REPAIR, MODULE_REPAIRS, RepairChoice, RepairComparison
from featcal.spec import EVALUATION, MERGING, RUNTIME, TASKS, RunSpec, build_spec, load_recipe

if TYPE_CHECKING:
    from featcal.repairs.registry import Repair


def run_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--recipe`` file's values by field name (the run's options and the repairs to compare); empty
    without one."""
    return load_recipe(args.recipe, extra=(RepairComparison,)) if getattr(args, "recipe", None) else {}


def spec_from_args(args: argparse.Namespace, recipe: dict[str, Any] | None = None) -> RunSpec:
    """The run spec: defaults, then the recipe (``recipe``, else the ``--recipe`` file), then the flags the
    user typed."""
    return build_spec(
        cli=given_values(args), recipe=run_recipe(args) if recipe is None else recipe,
        recipe_source=getattr(args, "recipe", None), progress=show_progress(args),
    )  # fmt: skip


def compared_repairs(args: argparse.Namespace, recipe: dict[str, Any]) -> list[Any] | None:
    """The repairs ``featcal run`` compares: ``--repair`` as typed, else the recipe's ``repair`` (its entries
    may also be ``{NAME: {KEY: VALUE}}`` mappings); checked by :func:`featcal.repairs.comparison.check_comparison`.

    Raises:
        InvalidParameterError: naming the recipe when its value is not a list of entries.
    """
    from featcal.repairs.entries import FLAG, recipe_entries

    typed = given_values(args, RepairComparison)
    if FLAG not in typed and FLAG in recipe:
        return recipe_entries(recipe[FLAG], owner=f"recipe {args.recipe}")
    return RepairComparison(**typed).repair


def cmd_run(args: argparse.Namespace) -> int:
    from featcal.distributed import session
    from featcal.pipeline import run_pipeline
    from featcal.runfolder.layout import RELEASE_DIR

    recipe = run_recipe(args)
    spec = spec_from_args(args, recipe)
    repairs = compared_repairs(args, recipe)
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
    from featcal.single_stage.merge import merge_model

    spec = spec_from_args(args)
    merged = merge_model(spec, args.output, uses_data=check_merge_data_options(args, spec))
    if merged is not None:
        print(path_line(f"Merged model ({spec.merge_method}, {merged.experts} experts)", merged.folder))
    return 0


# The run options a data-free repair (`featcal calibrate --method svc`) takes: where to compute and write.
DATA_FREE_OPTIONS = ("cache_dir", "device", "precision", "threads", "dist_timeout", "output_dtype")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from featcal.errors import InvalidParameterError
    from featcal.repairs.catalog import get_repair
    from featcal.single_stage.calibrate import calibrate_model

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
    folder = calibrate_model(spec_from_args(args), args.merged, args.output)
    if folder is not None:
        print(path_line("Calibrated model", folder))
    return 0


def repair_folder(args: argparse.Namespace, repair: Repair, params: dict[str, Any]) -> int:
    """`featcal calibrate --method NAME` for a data-free, weight-only repair (SVC): the base and experts the
    merged folder records, no tasks nor data (a task or calibration option given is refused), one process.

    Raises:
        InvalidParameterError: for an option it does not read, or a bad hyper-parameter.
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.errors import InvalidParameterError
    from featcal.single_stage.repair import repair_weights

    values = given_values(args)
    given = [name for name in values if name not in DATA_FREE_OPTIONS]
    if given:
        raise InvalidParameterError(
            given[0], values[given[0]], "given only with a repair that reads tasks or calibration data (featcal): "
            f"{repair.name} is data-free and reads the base and experts its --merged folder records",
        )  # fmt: skip
    resolved = repair.resolved_params(**params)
    folder = repair_weights(spec_from_args(args), repair, resolved, args.merged, args.output)
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
    from featcal.single_stage.repair import repair_lot

    refuse_featcal_parameters(args, repair)
    resolved = repair.resolved_params(**params)
    repaired = repair_lot(spec_from_args(args), repair, resolved, args.merged, args.output)
    print(path_line(f"Repaired model ({repair.name}, {repaired.tasks} tasks)", repaired.folder))
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
    from featcal.single_stage.repair import repair_modules

    refuse_featcal_parameters(args, repair)
    resolved = repair.resolved_params(**params)
    repaired = repair_modules(spec_from_args(args), repair, resolved, args.merged, args.output, evaluate=evaluate)
    print(path_line(f"{repair.pretty_name} modules ({repaired.tasks} tasks)", repaired.folder))
    if evaluate:
        for task, acc in repaired.report["accuracy"].items():
            print(f"{task}: accuracy {acc['accuracy']:.4f} (merge alone {acc['accuracy_without']:.4f})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from featcal.single_stage.evaluate import evaluate_model

    evaluated = evaluate_model(spec_from_args(args), args.model, args.output)
    if evaluated is None:
        return 0
    print(format_results({evaluated.name: evaluated.report}))
    if evaluated.output:
        print(path_line("Metrics", evaluated.output))
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
        exclude=("expert_model_format", "seed", "data", "eval_max_new_tokens", "lm_eval_tasks", "lm_eval_include",
                 "eval_protocol", "benchmark_data", "allow_code_execution", "mergebench_safety", "safety_judge"),
    )  # fmt: skip
    command(p, cmd_evaluate)

    p = subparsers.add_parser("methods", help="list the merging methods and the repairs, with their hyper-parameters")
    add_options(p, SuiteChoice, exclude=("json",), helps={"suite": "show the averages published for it",
                                                          "backbone": "… on this backbone"})  # fmt: skip
    command(p, cmd_methods)
