"""The one typed definition of a run: every option's name, type, default, range and help.

Everything else derives from :class:`RunSpec` (its FeatCal parameters are
:class:`~featcal.calibration.params.FeatCalParams`, defined beside the calibration): the
command-line flags and their help (:mod:`featcal.cli.options`), the validation and type conversion
of YAML recipes (:func:`load_recipe`, :func:`build_spec`), the run record and the recipe table of the
model card. Options, their conversion and their error wording are :mod:`featcal.options`'. This
module imports neither torch nor transformers, so ``featcal --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from featcal.calibration.params import GROUP as FEATCAL
from featcal.calibration.params import FeatCalParams
from featcal.calibration.stream_storage import AUTO, STREAM_STORAGES
from featcal.errors import FeatcalError, InputError, InvalidParameterError, UnknownNameError
from featcal.families.registry import run_option_classes
from featcal.options import (
    DIAGNOSTICS,
    EVALUATION,
    MERGING,
    OUTPUT,
    RUNTIME,
    STAGES,
    TASKS,
    convert_field,
    flag_name,
    option,
    option_fields,
    validate,
)
from featcal.precision import BASE_DTYPE, OUTPUT_DTYPES, PRECISIONS
from featcal.suites import (
    BACKBONE_NAMES,
    DEFAULT_SUITE,
    OUTPUT_DIR_PATTERN,
    SUITE_NAMES,
    default_backbone,
    default_output_dir,
    suite_backbones,
)


def default_eval_workers() -> int:
    """Data-loading workers for evaluation: one per CPU, at most 8."""
    return min(8, os.cpu_count() or 1)


T = TypeVar("T")


def _family_options_class() -> type:
    """The dataclass of every family's run options: one field per family that declares some, by its name."""
    fields = [(name, cls, field(default_factory=cls)) for name, cls in run_option_classes()]
    doc = """The model families' own run options (``ModelFamily.run_options``), one field per family.

    Its fields are flattened into the run's options (:func:`featcal.options.option_fields`): flags, recipe keys and
    their help are the families' own, listed where the field sits in :class:`RunSpec`.
    """
    namespace = {"__module__": __name__, "__doc__": doc}
    return dataclasses.make_dataclass("FamilyOptions", fields, frozen=True, namespace=namespace)


FamilyOptions = _family_options_class()


def family_options(values: Mapping[str, Any] | None = None) -> Any:
    """The families' run options of ``values``, by option name (``eval_max_new_tokens``); the others' defaults.

    Raises:
        TypeError: for a name no family's options have.
        InvalidParameterError: for a value that does not fit.
    """
    values = dict(values or {})
    built = {}
    for name, cls in run_option_classes():
        own = {f.name: values.pop(f.name) for f in dataclasses.fields(cls) if f.name in values}
        built[name] = cls(**own)
    if values:
        raise TypeError(f"no model family has the run option(s) {sorted(values)}")
    return FamilyOptions(**built)


@dataclass(frozen=True)
class RunSpec:
    """Everything a run depends on; the field names are the `featcal run` options' and recipe keys.

    Build one directly from Python (values are converted and checked), or from a recipe and
    command-line values with :func:`build_spec`.

    Raises:
        InvalidParameterError: when a value has the wrong type or lies outside its range, when
            ``skip_ta`` and ``ta_model_path`` are not given together, or when a task is named twice.
    """

    output_dir: str | None = option(
        None, help=f"run folder (default {OUTPUT_DIR_PATTERN.format(backbone='BACKBONE', suite='SUITE')}; "
        "outputs/BACKBONE-mergebench for mergebench)",
        group=OUTPUT, metavar="DIR",
    )  # fmt: skip
    force: bool = option(
        False, help="redo every stage, and replace a run of other tasks or base model in output-dir", group=OUTPUT
    )
    output_dtype: str = option(
        BASE_DTYPE, help="dtype the written weights are stored in: base (a language model's base dtype, e.g. "
        "bfloat16) or float32 (language models; CLIP vision models are always written in float32); the "
        "arithmetic is float32 either way", group=OUTPUT, metavar="DTYPE", choices=OUTPUT_DTYPES,
    )  # fmt: skip
    suite: str = option(
        DEFAULT_SUITE, help=f"built-in task suite, {' | '.join(SUITE_NAMES)}: FusionBench's 8, 14 or 20 CLIP tasks, "
        "its 8 GLUE tasks for FLAN-T5, or MergeBench's five language-model tasks (see `featcal tasks`)", group=TASKS,
        metavar="SUITE", choices=SUITE_NAMES,
    )  # fmt: skip
    backbone: str | None = option(
        None, help=f"the suite's backbone, {' | '.join(BACKBONE_NAMES)}: the base and expert ids of the built-in "
        "suite (default: b32 for CLIP's suites, flan-t5-base for glue8, llama-3.2-3b for mergebench)", group=TASKS,
        metavar="BACKBONE", choices=BACKBONE_NAMES,
    )  # fmt: skip
    tasks: list[str] | None = option(
        None, help="tasks to use (default: every task of tasks-file, else every task of the suite)", group=TASKS,
        metavar="TASK", nargs="+",
    )  # fmt: skip
    tasks_file: str | None = option(
        None, help="JSON or YAML task table adding to (or replacing) the built-in suite's tasks", group=TASKS,
        metavar="FILE",
    )  # fmt: skip
    data: str | None = option(
        None, help="calibration data of each expert of a causal-LM or T5 merge (YAML: experts -> dataset and text "
        "format, or input/target templates; docs/causal-lm.md, docs/seq2seq.md): the tasks, one per expert, "
        "instead of tasks-file and suite", group=TASKS,
        metavar="FILE",
    )  # fmt: skip
    base_model_id: str | None = option(
        None, help="base model, Hub id or folder, of the tasks' family: a CLIPModel (image tasks), a causal LM or a "
        "T5 (default: the suite backbone's, openai/clip-vit-base-patch32 for b32; a data file's: needed)",
        group=TASKS, metavar="ID_OR_DIR",
    )  # fmt: skip
    expert_model_format: str | None = option(
        None, help="expert id or folder pattern with {task} (default: each task's 'expert' entry)", group=TASKS,
        metavar="PATTERN",
    )  # fmt: skip
    cache_dir: str | None = option(None, help="Hub cache folder", group=TASKS, metavar="DIR")
    merge_method: str = option(
        "task_arithmetic", help="merging method (see `featcal methods`)", group=MERGING, metavar="NAME"
    )
    ta_scaling_factor: float | None = option(
        None, help="scaling factor κ of the task vectors (methods that have one; default 0.3)", group=MERGING,
        metavar="K", symbol="κ",
    )  # fmt: skip
    merge_params: dict[str, Any] = option(
        default_factory=dict, help="any other hyper-parameter of the merging method, repeatable", group=MERGING,
        metavar="KEY=VALUE", flag="merge_param",
    )  # fmt: skip
    featcal: FeatCalParams = field(default_factory=FeatCalParams)
    allow_fewer_calibration_examples: bool = option(
        False, help="use every train example of a task whose train split is smaller than the number asked for "
        "(recorded in run_config.json, metrics and card); else that is an error", group=FEATCAL,
    )  # fmt: skip
    stream_storage: str = option(
        AUTO, help="where each task's feature streams live between their uses: device, host (in host memory, "
        "copied to the device while the task is used: the device holds one task's streams instead of all), or "
        "auto (on CUDA: on the device while they take at most a third of its memory, the rest in host memory)",
        group=FEATCAL, choices=STREAM_STORAGES,
    )  # fmt: skip
    eval_batch_size: int | None = option(
        None, help="test examples per batch (default: images 256 on CUDA, 16 on the CPU; texts 16 on CUDA, 4 on the "
        "CPU, 100 there for models narrower than 256; T5 pairs 32)", group=EVALUATION, metavar="B", ge=1,
    )  # fmt: skip
    eval_num_workers: int = option(
        default_factory=default_eval_workers, help="data-loading workers (default: min(8, CPUs))",
        group=EVALUATION, metavar="W", ge=0,
    )  # fmt: skip
    max_eval_samples: int | None = option(
        None, help="evaluate only the first N test examples per task (quick runs; language tasks: the first N "
        "held-out texts, and N examples per lm-eval task)", group=EVALUATION, metavar="N", ge=1,
    )  # fmt: skip
    # The families' own options (a language model's evaluation: eval_max_new_tokens, lm_eval_*), carried opaquely.
    family_options: FamilyOptions = field(default_factory=family_options)
    device: str = option("auto", help="auto, cpu, cuda or cuda:N (merging, calibration and evaluation)", group=RUNTIME)
    precision: str = option(
        "float32", help="float32 (IEEE everywhere, cuDNN included), tf32 (TF32 in CUDA matmuls and convolutions, "
        "faster on Ampere and newer), or bf16 (FeatCal's layer forwards under bfloat16 autocast on any device; "
        "its statistics and solves, and all other work, stay float32)",
        group=RUNTIME, choices=PRECISIONS,
    )  # fmt: skip
    threads: int | None = option(
        None, help="torch CPU threads (default: 1 for models narrower than 256, else one per core)",
        group=RUNTIME, metavar="N", ge=1,
    )  # fmt: skip
    seed: int = option(42, help="seed of the calibration shuffle", group=RUNTIME, ge=0, le=2**32 - 1)
    dist_timeout: float = option(
        1800.0, help="under torchrun: seconds a process waits for the others in a collective before failing",
        group=RUNTIME, metavar="S", gt=0,
    )  # fmt: skip
    skip_ta: bool = option(False, help="start from ta-model-path instead of merging", group=STAGES)
    ta_model_path: str | None = option(None, help="merged model folder for skip-ta", group=STAGES, metavar="DIR")
    skip_eval_ta: bool = option(False, help="do not evaluate the merged baseline", group=STAGES)
    skip_featcal: bool = option(False, help="merge (and evaluate) only", group=STAGES)
    eval_zero_shot: bool = option(False, help="also evaluate the base model zero-shot", group=STAGES)
    eval_experts: bool = option(False, help="also evaluate each expert on its own task", group=STAGES)
    no_export: bool = option(False, help="do not write the release folder (<output-dir>/release)", group=STAGES)
    diagnose: bool = option(
        False, help="also measure the feature drift of the merged and calibrated models from the experts "
        "(<output-dir>/diagnostics.json and .png, shown in the model card)", group=STAGES,
    )  # fmt: skip
    diagnose_split: str = option(
        "test", help="images the feature drift is measured on: each task's first test images, or the run's "
        "calibration images", group=DIAGNOSTICS, metavar="SPLIT", choices=("test", "calibration"),
    )  # fmt: skip
    diagnose_images: int = option(
        256, help="images per task for the feature drift", group=DIAGNOSTICS, metavar="N", ge=1
    )
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.featcal, Mapping):
            object.__setattr__(self, "featcal", FeatCalParams(**self.featcal))
        if isinstance(self.family_options, Mapping):
            object.__setattr__(self, "family_options", family_options(self.family_options))
        validate(self)
        if self.backbone is None:
            object.__setattr__(self, "backbone", default_backbone(self.suite))
        backbones = suite_backbones(self.suite)
        if self.backbone not in backbones:
            raise InvalidParameterError("backbone", self.backbone, f"one of {self.suite}'s: {', '.join(backbones)}")
        if self.output_dir is None:
            object.__setattr__(self, "output_dir", default_output_dir(self.suite, self.backbone))
        for own in self._families():  # each family's own checks of its options together
            check = getattr(own, "check", None)
            if check is not None:
                check(self)
        if self.skip_ta and not self.ta_model_path:
            raise InvalidParameterError(
                "ta_model_path", None, "the merged model folder to start from, since skip_ta is set"
            )
        if self.ta_model_path and not self.skip_ta:
            raise InvalidParameterError(
                "skip_ta", False, "set with ta_model_path, to start from that merged model instead of merging"
            )
        repeated = sorted({task for task in self.tasks or () if list(self.tasks).count(task) > 1})
        if repeated:
            raise InvalidParameterError("tasks", " ".join(repeated), "each task named once (repeated here)")
        if self.data is not None and self.tasks_file is not None:
            raise InvalidParameterError("data", self.data, "given without tasks_file: the data file names the tasks")
        if self.diagnose and self.skip_featcal and self.diagnose_split == "calibration":
            raise InvalidParameterError(
                "diagnose_split", self.diagnose_split, "test, since skip_featcal is set (no calibration images)"
            )

    def _families(self) -> list[Any]:
        """Each family's options object, in :class:`FamilyOptions`' order."""
        return [getattr(self.family_options, f.name) for f in dataclasses.fields(self.family_options)]

    def options(self, cls: type[T]) -> T:
        """A family's run options, as this run sets them.

        Args:
            cls: The family's options class (``ModelFamily.run_options``).

        Returns:
            The run's instance of it.

        Raises:
            KeyError: for a class no built-in family declares.
        """
        for own in self._families():
            if isinstance(own, cls):
                return own
        raise KeyError(cls.__name__)

    def method_params(self) -> dict[str, Any]:
        """The merging method's hyper-parameters: ``merge_params`` with ``ta_scaling_factor`` folded in."""
        params = dict(self.merge_params)
        if self.ta_scaling_factor is not None:
            params["scaling_factor"] = self.ta_scaling_factor
        return params

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)


# --- fields, recipes and layering ----------------------------------------------------------------


def recipe_keys(extra: tuple[type, ...] = ()) -> dict[str, str]:
    """Every accepted recipe key (``lambda-ratio``) mapped to its field name (``lambda_ratio``): the run's
    options and those of the option classes ``extra``."""
    return {flag_name(f): f.name for cls in (RunSpec, *extra) for f, _, _ in option_fields(cls)}


def load_recipe(path: str | Path, extra: tuple[type, ...] = ()) -> dict[str, Any]:
    """The recipe's raw values keyed by field name; unknown keys are an error naming them.

    Keys are the option names without the leading dashes (``merge-method`` or ``merge_method``): the run's,
    and those of the option classes ``extra`` (the command's options outside the run spec, such as
    ``featcal run``'s ``repair``). Values are converted and checked by :func:`build_spec` (the run's) and by
    the command (``extra``'s).

    Raises:
        InputError: when the file is missing or not a YAML mapping.
        UnknownNameError: for a key that is not an option.
    """
    from featcal.files.reading import read_structured

    path = Path(path).expanduser()
    data = read_structured(path, "Recipe") or {}
    if not isinstance(data, Mapping):
        raise InputError(path, f"Recipe {path}: expected a mapping of option names to values.")
    keys = recipe_keys(extra)
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("_", "-")
        if key not in keys:
            raise UnknownNameError(
                "option",
                str(raw_key),
                sorted(keys),
                where=f"Recipe {path}",
                hint="Use the names of `featcal run --help`.",
            )
        if keys[key] in values:  # lambda-ratio and lambda_ratio are one option
            raise InputError(path, f"Recipe {path} sets the option {key!r} twice: keep one.")
        values[keys[key]] = value
    return values


def build_spec(
    *,
    cli: Mapping[str, Any] | None = None,
    recipe: Mapping[str, Any] | None = None,
    recipe_source: str | Path | None = None,
    **internal: Any,
) -> RunSpec:
    """The run spec from its layers: defaults, then the recipe, then values given on the command line.

    Args:
        cli: Values given on the command line, by field name (only those the user typed).
        recipe: Values read by :func:`load_recipe`, by field name.
        recipe_source: The recipe's path, named in errors about its values.
        **internal: Fields that are not options (``progress``).

    Returns:
        The checked :class:`RunSpec`. ``merge_params`` merge key by key, the command line winning.

    Raises:
        InvalidParameterError: naming the recipe key or the parameter whose value does not fit.
    """
    run_values: dict[str, Any] = dict(internal)
    featcal_values: dict[str, Any] = {}
    family_values: dict[str, Any] = {}  # the families' options, by name (family_options sorts them)
    layers = [(recipe or {}, f"recipe {recipe_source}" if recipe_source else "recipe"), (cli or {}, None)]
    for values, owner in layers:
        for f, annotation, cls in option_fields(RunSpec):
            if f.name not in values:
                continue
            value = convert_field(f, annotation, values[f.name], owner=owner)
            target = run_values if cls is RunSpec else featcal_values if cls is FeatCalParams else family_values
            if f.name == "merge_params":
                value = {**target.get(f.name, {}), **value}
            target[f.name] = value
    try:
        return RunSpec(featcal=FeatCalParams(**featcal_values), family_options=family_values, **run_values)
    except InvalidParameterError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - a field list out of step with RunSpec
        raise FeatcalError(f"Inconsistent run options: {exc}") from None
