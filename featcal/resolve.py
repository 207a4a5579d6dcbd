"""The one resolver of a run's models: its family, base and experts, from a run spec or a run folder.

``featcal run``, ``merge``, ``calibrate`` and ``evaluate`` resolve them from the spec
(:func:`resolve_inputs`); ``featcal sweep`` and ``diagnose`` from a run folder's record
(:func:`run_inputs`). Both go through :func:`resolve_models`, which downloads what is named by Hub id,
checks every folder with its family, and reads the tensors lazily; nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import InvalidParameterError, ModelInputError, RunFolderError
from featcal.families import get_family, mergekit_reader
from featcal.files.reading import check_model_text_files
from featcal.hub.downloads import resolve_model_folder
from featcal.merging import get_method
from featcal.runfolder.layout import RUN_CONFIG
from featcal.suites import DEFAULT_SUITE, suite_family, task_table
from featcal.tasks import Task

if TYPE_CHECKING:
    from featcal.checkpoint import Checkpoint
    from featcal.families.base import ModelFamily
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec


@dataclass
class RunInputs:
    """A run's resolved inputs: its family, tasks, model folders and lazily-read checkpoints.

    Attributes:
        family: The model family of the tasks.
        tasks: The tasks, in order.
        base_ref: The base model as given (a Hub id, or a folder's absolute path).
        base_folder: The base model's folder (downloaded when ``base_ref`` is a Hub id).
        expert_refs: Each task's expert as given.
        experts: Each task's expert tensors, checked against the base's.
        base: The base's tensors.
        merge_params: The merging method's hyper-parameters, every one resolved.
    """

    family: ModelFamily
    tasks: list[Task]
    base_ref: str
    base_folder: Path
    expert_refs: dict[str, str] = field(default_factory=dict)
    experts: dict[str, Checkpoint] = field(default_factory=dict)
    base: Checkpoint | None = None
    merge_params: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def config(self) -> Any:
        """The configuration merged and calibrated models are written with (the base's)."""
        return self.family.model_config(self.base_folder)

    def model_commits(self) -> dict[str, str]:
        """The commit each Hub model was read at, by reference as given (base and experts; local ones left out)."""
        from featcal.hub.downloads import snapshot_commit

        folders = {self.base_ref: self.base_folder}
        folders.update({self.expert_refs[name]: expert.path for name, expert in self.experts.items()})
        commits = {ref: snapshot_commit(folder) for ref, folder in folders.items()}
        return {ref: commit for ref, commit in commits.items() if commit is not None}

    def local_folders(self) -> list[Path]:
        """The folders the run reads its models from: the base's and every expert's."""
        return [self.base_folder, *(expert.path for expert in self.experts.values())]


def tasks_family(tasks: Sequence[Task]) -> ModelFamily:
    """The model family every task belongs to.

    Raises:
        InvalidParameterError: naming ``tasks`` when they belong to several families.
    """
    families = sorted({t.family for t in tasks})
    if len(families) > 1:
        raise InvalidParameterError(
            "tasks", " ".join(t.name for t in tasks), f"tasks of one model family, not {families}"
        )
    return get_family(families[0])


def expert_ref(task: Task, pattern: str | None, table_pattern: str | None) -> str:
    """Where task's expert comes from: ``expert_model_format``, else the task's entry, else the table's pattern.

    Raises:
        InvalidParameterError: for a pattern without ``{task}`` or with other fields, or a task with no expert.
    """
    if pattern is not None:
        if "{task}" not in pattern:
            raise InvalidParameterError("expert_model_format", pattern, "a pattern containing '{task}'")
        try:
            return pattern.format(task=task.name)
        except (KeyError, IndexError, ValueError):
            raise InvalidParameterError(
                "expert_model_format", pattern, "a pattern whose only field is '{task}' (write '{{' for a brace)"
            ) from None
    if task.expert:
        return task.expert
    if table_pattern:
        return table_pattern.format(task=task.name)
    raise InvalidParameterError(
        "expert_model_format", None, f"a pattern with '{{task}}', since task {task.name!r} has no 'expert' entry"
    )


def resolve_models(
    family: ModelFamily,
    names: Sequence[str],
    base_ref: str,
    expert_refs: Mapping[str, str] | None,
    *,
    cache_dir: str | Path | None = None,
) -> tuple[Path, Checkpoint, dict[str, Checkpoint]]:
    """The base's folder and tensors, and the expert tensors of each task in ``names`` (none when
    ``expert_refs`` is None), each folder checked by ``family``, the experts against the base, every tensor
    finite.

    Raises:
        ModelInputError: when a model is missing, unreadable, not finite, of another family, of another
            architecture, configuration or tokenizer vocabulary than the base, or one expert serves two tasks
            (two references to one folder, or to one Hub commit).
        InputError: for a configuration or tokenizer file that is not UTF-8 text.
        HubError: when a Hub download fails for good.
    """
    from featcal.checkpoint import check_compatible

    base_folder = resolve_model_folder(base_ref, what="base model", cache_dir=cache_dir)
    check_model_text_files(base_folder)
    family.check_base_folder(base_folder)
    base = family.checkpoint(base_folder, name=f"base model {base_ref}")
    base.check_finite()
    experts: dict[str, Checkpoint] = {}
    seen: dict[Path, str] = {}  # each expert's folder, resolved -> its task
    for name in names if expert_refs is not None else ():
        ref = expert_refs[name]
        folder = resolve_model_folder(ref, what=f"expert for task {name!r}", cache_dir=cache_dir)
        other = seen.setdefault(folder.resolve(), name)
        if other != name:
            given = "" if expert_refs[other] == ref else f" (as {expert_refs[other]!r} and {ref!r})"
            raise ModelInputError(
                ref,
                f"Tasks {other!r} and {name!r} name one expert, {folder.resolve()}{given}: list each expert once.",
            )
        check_model_text_files(folder)
        experts[name] = family.checkpoint(folder, name=f"Expert for task {name!r} ({ref})")
    check_compatible(base, experts)
    for name, expert in experts.items():  # what the shapes do not tell: another model type, vocabulary, ...
        family.check_like_base(expert.path, base_folder, f"expert for task {name!r}")
    for expert in experts.values():
        expert.check_finite()
    return base_folder, base, experts


def check_output_dtype(family: ModelFamily, output_dtype: str) -> None:
    """Refuse an ``--output-dtype`` the family does not write its models in (CLIP's are float32 always).

    Raises:
        InvalidParameterError: naming the option, the family and what it writes.
    """
    if output_dtype not in family.output_dtypes:
        raise InvalidParameterError(
            "output_dtype", output_dtype, f"{' or '.join(family.output_dtypes)} for a {family.title}, which featcal "
            "always writes in float32 (the option is for language models)",
        )  # fmt: skip


def merge_description(folder: str | Path) -> tuple[str | None, list[str] | None]:
    """The base and the experts a merged model's folder records: featcal's own recipe, else mergekit's
    ``mergekit_config.yml``; ``(None, None)`` when it records neither.

    Raises:
        ModelInputError: when the record is damaged, or describes a merge featcal cannot calibrate.
        InputError: for a record or model file that is not UTF-8 text.
    """
    from featcal.model_recipe import read_model_recipe

    check_model_text_files(Path(folder))
    recipe = read_model_recipe(folder)
    if recipe is not None:
        return recipe.base_model, list(recipe.experts.values())
    mergekit = mergekit_reader().read_mergekit_folder(folder)
    if mergekit is not None:
        return mergekit.base_model, list(mergekit.models)
    return None, None


def check_recorded_base(base_ref: str, merged: Path) -> None:
    """Refuse a base folder that a merged folder's record names and that is gone, saying which file named it.

    Raises:
        ModelInputError: naming the folder, the record and ``--base-model-id``.
    """
    from featcal.hub.refs import local_path
    from featcal.model_recipe import MERGEKIT_FILE, RECIPE_FILE

    local = local_path(base_ref)
    if local is not None and not local.exists():
        record = merged / (RECIPE_FILE if (merged / RECIPE_FILE).is_file() else MERGEKIT_FILE)
        raise ModelInputError(
            base_ref,
            f"The base model folder {base_ref} does not exist; it is the base that {record} records: name the base "
            "with --base-model-id (a folder or a Hub id), which overrides it.",
        )


def check_data_covers_merge(table_experts: Sequence[str], merged: Sequence[str], data: str, folder: str) -> None:
    """Refuse a data file that misses an expert of the merge, or names one the merge does not have.

    Raises:
        InvalidParameterError: naming the expert and the fix.
    """
    from featcal.data_file import expert_key

    listed = {expert_key(ref): ref for ref in table_experts}
    merged_keys = {expert_key(ref): ref for ref in merged}
    missing = [ref for key, ref in merged_keys.items() if key not in listed]
    if missing:
        raise InvalidParameterError(
            "data", data, f"calibration texts for every expert the merge in {folder} merged; it lacks {missing}"
        )
    extra = [ref for key, ref in listed.items() if key not in merged_keys]
    if extra:
        raise InvalidParameterError(
            "data", data, f"only the experts the merge in {folder} merged ({list(merged)}); it also names {extra}"
        )


def check_model_family(folder: str | Path, family: ModelFamily, source: str) -> None:
    """Refuse a model folder (``featcal evaluate --model``) of another family than the tasks', before the
    tasks' base is looked for (or downloaded). A folder whose family cannot be read is left to the family's
    own checks, which word what is wrong with it.

    Args:
        folder: The model folder.
        family: The tasks' family.
        source: Where the tasks come from, in words (``the suite ta8``).

    Raises:
        InvalidParameterError: naming the folder's family and what to pass.
    """
    from featcal.errors import ModelInputError
    from featcal.families import family_of_folder, tasks_hint

    try:
        own = family_of_folder(folder)
    except ModelInputError:
        return
    if own.name != family.name:
        hint = tasks_hint(own)
        raise InvalidParameterError(
            "model", str(folder), f"a model of the tasks' family: it holds a {own.title} ({own.name}), while "
            f"{source} holds {family.title} tasks ({family.name}); pass its tasks with {hint}",
        )  # fmt: skip


def check_suite_family(spec: RunSpec, family: ModelFamily, source: str) -> None:
    """Refuse a suite named with tasks of another family (``--suite mergebench`` with a T5 data file or a CLIP
    tasks file), before any model is looked for: the suite's settings (its evaluation protocol, its paper's
    numbers) would not apply to those tasks. The default suite is not checked: a data file alone leaves it.

    Args:
        spec: The run's options.
        family: The tasks' family.
        source: Where the tasks come from, in words (``the data file data.yaml``).

    Raises:
        InvalidParameterError: naming the suite, the tasks' family and what to pass instead.
    """
    own = suite_family(spec.suite)
    if spec.suite != DEFAULT_SUITE and family.name != own:
        raise InvalidParameterError(
            "suite", spec.suite, f"a suite of the tasks' family: {source} holds {family.title} tasks ({family.name}), "
            f"while {spec.suite}'s are of the {own} family; leave out --suite {spec.suite} (and its options) or give "
            f"tasks of the {own} family",
        )  # fmt: skip


def resolve_inputs(
    spec: RunSpec, *, need_experts: bool = True, merged: str | Path | None = None, model: str | Path | None = None
) -> RunInputs:
    """Tasks, base and experts of a run spec, validated before anything is written.

    With ``merged`` (``featcal calibrate``'s merged folder), a base the spec does not name is the one the
    folder records (:func:`merge_description`), and a data file must list exactly the experts it merged.
    With ``model`` (``featcal evaluate``'s model folder), that folder must be of the tasks' family
    (:func:`check_model_family`).

    Raises:
        InvalidParameterError: for tasks, a base or an expert pattern that cannot be used, a suite or a model
            of another family than the tasks' (:func:`check_suite_family`, :func:`check_model_family`).
        ModelInputError: as :func:`resolve_models`.
    """
    if spec.data is not None:
        from featcal.data_file import read_data_file

        table = read_data_file(spec.data)
        names = spec.tasks
    else:
        table = task_table(spec.tasks_file, suite=spec.suite, backbone=spec.backbone)
        names = spec.tasks or (list(task_table(spec.tasks_file, replace=True).tasks) if spec.tasks_file else None)
    tasks = table.select(names)
    family = tasks_family(tasks)
    source = (
        f"the data file {spec.data}" if spec.data is not None
        else f"the tasks file {spec.tasks_file}" if spec.tasks_file else f"the suite {spec.suite}"
    )  # fmt: skip
    check_suite_family(spec, family, source)
    if model is not None:
        check_model_family(model, family, source)
    check_output_dtype(family, spec.output_dtype)
    described_base, described_experts = merge_description(merged) if merged is not None else (None, None)
    if spec.data is not None and described_experts is not None and need_experts:
        check_data_covers_merge([t.expert or "" for t in tasks], described_experts, spec.data, str(merged))
    base_ref = spec.base_model_id or table.base_model or described_base
    if not base_ref:
        hint = "" if merged is None else f" and the merged folder {merged} records none"
        raise InvalidParameterError("base_model_id", None, f"a Hub id or folder, since the task table names none{hint}")
    if merged is not None and base_ref == described_base and not (spec.base_model_id or table.base_model):
        check_recorded_base(base_ref, Path(merged))
    local = Path(base_ref).expanduser()
    base_ref = str(local.resolve()) if local.exists() else base_ref
    refs = (
        {t.name: expert_ref(t, spec.expert_model_format, table.expert_model_pattern) for t in tasks}
        if need_experts
        else None
    )
    base_folder, base, experts = resolve_models(
        family, [t.name for t in tasks], base_ref, refs, cache_dir=spec.cache_dir
    )
    # a suite's own settings of the method (MergeBench's Task Arithmetic), under those the spec gives
    defaults = dict(table.merge_defaults.get(spec.merge_method, {}))
    params = get_method(spec.merge_method).resolved_params(**{**defaults, **spec.method_params()})
    return RunInputs(family, tasks, base_ref, base_folder, refs or {}, experts, base, params)


def run_inputs(run: RunFolder, cache_dir: str | Path | None = None) -> RunInputs:
    """The family, base, experts and tasks a run folder's record names, resolved and checked.

    Raises:
        RunFolderError: when the run names no expert for a task.
        ModelInputError: as :func:`resolve_models`.
    """
    refs = dict(run.experts)
    missing = [t.name for t in run.tasks if t.name not in refs]
    if missing:
        raise RunFolderError(
            run.path / RUN_CONFIG,
            f"{run.path / RUN_CONFIG} names no expert for task(s) {missing}: this needs every task's expert.",
        )
    family = get_family(run.record.family)
    base_folder, base, experts = resolve_models(
        family, [t.name for t in run.tasks], run.base_model, refs, cache_dir=cache_dir
    )
    return RunInputs(family, list(run.tasks), run.base_model, base_folder, refs, experts, base, dict(run.merge_params))
