"""Built-in task suites (``ta8``, ``ta14``, ``ta20``; ``mergebench``) and their backbones.

FusionBench's standard CLIP benchmark merges experts of three backbones (``b32``, ``b16``, ``l14``)
on 8, 14 and 20 tasks. ``featcal/resources/suites.json`` says which tasks form each suite, which base
and expert ids each backbone has, and the accuracies FusionBench publishes; the tasks themselves are
described once, the eight TA8 tasks in ``ta8_tasks.json`` and the twelve others in
``tall_tasks.json``. Both files name the FusionBench files (and commit) their facts come from.

MergeBench's language-model benchmark (``mergebench``) merges five experts of four backbones of its own
(``llama-3.2-3b``, ``llama-3.1-8b``, ``gemma-2-2b``, ``gemma-2-9b``); ``mergebench.json`` describes its
tasks (datasets and text formats), its merge settings, the lm-evaluation-harness tasks of each task,
and the reference numbers quoted for it, with the files they come from.

:func:`suite_table` builds the task table of a suite for a backbone. The defaults, ``ta8`` on
``b32``, give the TA8 table exactly as shipped, so runs recorded before suites existed keep their
identity. This module reads JSON only: ``featcal --help`` and ``featcal tasks`` import no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from featcal.errors import FeatcalError, UnknownNameError
from featcal.families.registry import DEFAULT_FAMILY

if TYPE_CHECKING:
    from pathlib import Path

    from featcal.tasks import TaskTable

SUITES_RESOURCE = "suites.json"
TALL_TABLE = "tall_tasks.json"
GLUE_TABLE = "glue8_tasks.json"  # the GLUE tasks of FusionBench's FLAN-T5 benchmark (the seq2seq family)
SINGLE_MODEL_KINDS = ("zero_shot", "expert")
OUTPUT_DIR_PATTERN = "outputs/clip-vit-{backbone}-{suite}"  # a run folder's default, unless its suite names one
# Where the CLIP backbones' single-model numbers come from (a backbone may name its own source).
CLIP_SINGLE_SOURCE = "FusionBench (docs/modelpool/clip_vit.md, 'The 20-Task Model Collections')"


@cache
def _resource(name: str) -> dict[str, Any]:
    return json.loads(resources.files("featcal.resources").joinpath(name).read_text(encoding="utf-8"))


def suites_data() -> dict[str, Any]:
    """The parsed ``suites.json`` (suites, backbones, reference accuracies, sources)."""
    return _resource(SUITES_RESOURCE)


SUITE_NAMES: tuple[str, ...] = tuple(suites_data()["suites"])
BACKBONE_NAMES: tuple[str, ...] = tuple(suites_data()["backbones"])
DEFAULT_SUITE: str = suites_data()["default_suite"]
DEFAULT_BACKBONE: str = suites_data()["default_backbone"]


def suite_family(suite: str) -> str:
    """The model family of ``suite``'s tasks (``clip_vision``, ``causal_lm``).

    Raises:
        UnknownNameError: for a suite that is not built in.
    """
    suite_task_names(suite)
    return suites_data()["suites"][suite].get("family", DEFAULT_FAMILY)


def suite_names(family: str) -> tuple[str, ...]:
    """The built-in suites of one model family (the Space serves CLIP's)."""
    return tuple(name for name in SUITE_NAMES if suite_family(name) == family)


def suite_backbones(suite: str) -> list[str]:
    """The backbones ``suite`` can run on: its own list, else every backbone of its family.

    Raises:
        UnknownNameError: for a suite that is not built in.
    """
    family = suite_family(suite)
    listed = suites_data()["suites"][suite].get("backbones")
    if listed:
        return list(listed)
    entries = suites_data()["backbones"]
    return [name for name, entry in entries.items() if entry.get("family", DEFAULT_FAMILY) == family]


def default_backbone(suite: str) -> str:
    """The backbone of ``suite`` when none is chosen: ``b32`` for CLIP's suites, else the suite's first."""
    names = suite_backbones(suite)
    return DEFAULT_BACKBONE if DEFAULT_BACKBONE in names else names[0]


def check_backbone(suite: str, backbone_name: str) -> None:
    """Refuse a backbone ``suite`` does not run on.

    Args:
        suite: A built-in suite.
        backbone_name: The backbone asked for.

    Raises:
        UnknownNameError: naming the backbone and the suite's backbones.
    """
    backbone(backbone_name)
    names = suite_backbones(suite)
    if backbone_name not in names:
        raise UnknownNameError("backbone", backbone_name, names, where=f"Suite {suite}")


def default_output_dir(suite: str, backbone_name: str) -> str:
    """The run folder of ``suite`` on ``backbone_name`` when none is given (``outputs/clip-vit-b32-ta8``).

    Args:
        suite: A built-in suite.
        backbone_name: One of its backbones.

    Returns:
        The folder, relative to the working directory (``outputs/llama-3.2-3b-mergebench``).
    """
    pattern = suites_data()["suites"][suite].get("output_dir", OUTPUT_DIR_PATTERN)
    return pattern.format(backbone=backbone_name, suite=suite)


@dataclass(frozen=True)
class Backbone:
    """A backbone: its title, base model id and the pattern of its experts' ids (with ``{task}``)."""

    name: str
    title: str
    base_model: str
    expert_model_pattern: str

    def expert(self, task: str) -> str:
        """The id of this backbone's expert for ``task``."""
        return self.expert_model_pattern.format(task=task)


def backbone(name: str) -> Backbone:
    """The backbone called ``name`` (``b32``, ``b16``, ``l14``, ``llama-3.2-3b``, ...).

    Raises:
        UnknownNameError: for another name, listing the known ones.
    """
    entries = suites_data()["backbones"]
    if name not in entries:
        raise UnknownNameError("backbone", name, list(BACKBONE_NAMES))
    entry = entries[name]
    return Backbone(name, entry["title"], entry["base_model"], entry["expert_model_pattern"])


def suite_task_names(suite: str) -> list[str]:
    """The tasks of ``suite``, in FusionBench's order.

    Raises:
        UnknownNameError: for a suite that is not built in.
    """
    entries = suites_data()["suites"]
    if suite not in entries:
        raise UnknownNameError("suite", suite, list(SUITE_NAMES))
    return list(entries[suite]["tasks"])


def suite_title(suite: str) -> str:
    """The suite's description in words."""
    suite_task_names(suite)  # raises for an unknown suite
    return suites_data()["suites"][suite]["title"]


def single_model_reference(backbone_name: str) -> dict[str, dict[str, float]]:
    """FusionBench's published accuracies of single models of ``backbone_name``, by kind then task.

    Returns:
        ``{"zero_shot": {task: accuracy}, "expert": {task: accuracy}}``: the pre-trained CLIP, and each
        task's own expert on its task. Accuracies are fractions. Empty for a backbone FusionBench publishes
        none for (the language models').
    """
    backbone(backbone_name)
    published = suites_data()["reference_accuracy"]["single_model"].get(backbone_name, {})
    return {kind: dict(published.get(kind, {})) for kind in SINGLE_MODEL_KINDS}


def merged_reference(suite: str, backbone_name: str) -> dict[str, dict[str, float]]:
    """Published merge accuracies for ``suite`` on ``backbone_name``, by method then task (and ``average``).

    The CLIP ViT-B/32 TA8 numbers are the FeatCal reference run's (``ta8_tasks.json``); the others
    FusionBench's. Empty where nothing is published (FusionBench gives no per-task merge accuracies
    for 14 or 20 tasks). A language-model suite's are averages only (MergeBench's benchmarks, as the
    FeatCal paper reports them: see :func:`reference_source`).

    Raises:
        UnknownNameError: for a suite or backbone that is not built in.
    """
    suite_task_names(suite)
    backbone(backbone_name)
    if (suite, backbone_name) == (DEFAULT_SUITE, DEFAULT_BACKBONE):
        return _ta8_reference()
    table = _text_suite(suite)
    if table is not None:
        averages = table.get("reference", {}).get(backbone_name, {})
        return {method: {"average": float(value)} for method, value in averages.items()}
    published = suites_data()["reference_accuracy"]["merged"].get(backbone_name, {}).get(suite, {})
    return {method: dict(values) for method, values in published.items()}


def _ta8_reference() -> dict[str, dict[str, float]]:
    from featcal.tasks import builtin_tasks

    table = builtin_tasks()
    methods = {m for t in table.tasks.values() for m in t.reference_accuracy}
    out = {
        m: {n: t.reference_accuracy[m] for n, t in table.tasks.items() if m in t.reference_accuracy} for m in methods
    }
    for method, average in table.reference_average.items():
        out.setdefault(method, {})["average"] = float(average)
    return dict(sorted(out.items()))


def reference_source(suite: str, backbone_name: str) -> str:
    """Where the merge references of ``suite`` on ``backbone_name`` come from, in words."""
    if (suite, backbone_name) == (DEFAULT_SUITE, DEFAULT_BACKBONE):
        return "the FeatCal reference run (arXiv 2605.13030)"
    table = _text_suite(suite)
    if table is not None:
        return str(table["reference_source"])
    own = suites_data()["backbones"][backbone_name].get("reference_source")
    if own:
        return own
    title, count = backbone(backbone_name).title, len(suite_task_names(suite))
    return f"FusionBench (docs/modelpool/clip_vit.md, {title}, {count} tasks)"


def featcal_settings_source(suite: str) -> str | None:
    """Where the FeatCal parameters of a run on a language-model suite come from when they are featcal's
    defaults (the CLIP reference run's), in words; None for a CLIP suite, whose defaults are its own.

    Raises:
        UnknownNameError: for a suite that is not built in.
    """
    suite_task_names(suite)
    table = _text_suite(suite)
    return None if table is None else table.get("featcal_settings")


def _text_suite(suite: str) -> dict[str, Any] | None:
    """The resource describing a language-model suite's tasks (``mergebench.json``); None for CLIP's."""
    name = suites_data()["suites"][suite].get("table")
    return _resource(name) if name else None


def suite_lm_eval(suite: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The lm-evaluation-harness tasks of each task of a language-model suite, and, by task, what its
    benchmark evaluates that featcal does not run (code execution, safety classifiers), in words.

    Raises:
        UnknownNameError: for a suite that is not built in.
    """
    suite_task_names(suite)
    table = _text_suite(suite) or {}
    return {k: list(v) for k, v in table.get("lm_eval", {}).items()}, dict(table.get("not_run", {}))


def _text_suite_table(suite: str, model: Backbone) -> TaskTable:
    """The task table of a language-model suite on ``model``: tasks from its resource, each with its expert."""
    from featcal.tasks import parse_task_table

    data = _text_suite(suite) or {}
    table = parse_task_table({"tasks": data["tasks"]}, source=f"built-in {suite}")
    tasks = {name: replace(table.tasks[name], expert=model.expert(name)) for name in suite_task_names(suite)}
    return replace(
        table,
        tasks=tasks,
        base_model=model.base_model,
        expert_model_pattern=model.expert_model_pattern,
        reference_average=_averages(merged_reference(suite, model.name)),
        merge_defaults={method: dict(params) for method, params in data.get("merge", {}).items()},
        source=f"built-in {suite} ({model.title})",
    )


def suite_table(suite: str | None = None, backbone_name: str | None = None) -> TaskTable:
    """The built-in task table of ``suite`` with ``backbone_name``'s base model and experts.

    Each task's ``reference_accuracy`` holds the merge accuracies published for this suite and
    backbone (none for most: see :func:`merged_reference`), with their source in ``reference_source``.
    ``ta8`` on ``b32`` is the TA8 table exactly as shipped. A language-model suite's table carries its
    merge settings (``merge_defaults``) and its reference averages.

    Args:
        suite: ``ta8``, ``ta14``, ``ta20``, ``mergebench`` or ``glue8``; None: :data:`DEFAULT_SUITE`.
        backbone_name: One of the suite's backbones (:func:`suite_backbones`); None: its default.

    Raises:
        UnknownNameError: for a suite or backbone that is not built in, or a backbone of another suite
            (``glue8`` runs on ``flan-t5-base``).
    """
    from featcal.tasks import builtin_tasks, parse_task_table

    suite = suite or DEFAULT_SUITE
    backbone_name = backbone_name or default_backbone(suite)
    names = suite_task_names(suite)
    check_backbone(suite, backbone_name)
    model = backbone(backbone_name)
    if _text_suite(suite) is not None:
        return _text_suite_table(suite, model)
    ta8 = builtin_tasks()
    if (suite, backbone_name) == (DEFAULT_SUITE, DEFAULT_BACKBONE):
        return ta8
    tables = [parse_task_table(_resource(TALL_TABLE), source="built-in TALL tasks")]
    if any(name not in ta8.tasks for name in names):
        tables.append(parse_task_table(_resource(GLUE_TABLE), source="built-in GLUE tasks"))
    known = {**ta8.tasks, **{name: task for table in tables for name, task in table.tasks.items()}}
    published = merged_reference(suite, backbone_name)
    source = reference_source(suite, backbone_name)
    tasks = {}
    for name in names:
        reference = {method: values[name] for method, values in published.items() if name in values}
        tasks[name] = replace(
            known[name],
            expert=model.expert(name),
            reference_accuracy=reference,
            reference_source=source if reference else None,
        )
    return replace(
        ta8,
        tasks=tasks,
        base_model=model.base_model,
        expert_model_pattern=model.expert_model_pattern,
        reference_average=_averages(published),
        source=f"built-in {suite.upper()} ({model.title})",
    )


def _averages(published: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {method: values["average"] for method, values in published.items() if "average" in values}


def describe_suite(suite: str | None = None, backbone_name: str | None = None) -> dict[str, Any]:
    """What `featcal tasks` lists: the suite's tasks on a backbone, with their data and reference numbers.

    Args:
        suite: ``ta8``, ``ta14``, ``ta20``, ``mergebench`` or ``glue8``; None: :data:`DEFAULT_SUITE`.
        backbone_name: One of the suite's backbones; None: its default (:func:`default_backbone`).

    Returns:
        A JSON-able mapping: the suite, its family, backbone, base and expert pattern; per task its
        dataset id, configuration, splits, expert id and reference numbers, and for a CLIP task its
        number of classes and templates (``zero_shot`` and ``expert`` accuracies from FusionBench, and
        each merging method's where published; for a text-to-text task of glue8 the same, its number of
        label words as classes, its one input template, its ``metric``, and FusionBench's FLAN-T5 scores:
        the listing of the task's format),
        for a language task the columns its text format reads,
        how its answer is found (exact match) or none, and its lm-evaluation-harness tasks; the published
        merge averages; a language suite's merge settings, where its FeatCal parameters come from and what
        it does not run; and where the numbers come from.

    Raises:
        UnknownNameError: for a suite or backbone that is not built in, or a backbone of another suite.
    """
    suite = suite or DEFAULT_SUITE
    backbone_name = backbone_name or default_backbone(suite)
    table = suite_table(suite, backbone_name)
    model = backbone(backbone_name)
    family = suite_family(suite)
    listing = {
        "suite": suite,
        "title": suite_title(suite),
        "family": family,
        "backbone": backbone_name,
        "backbone_title": model.title,
        "base_model": model.base_model,
        "expert_model_pattern": model.expert_model_pattern,
        "reference_average": dict(table.reference_average),
        "merged_reference_source": reference_source(suite, backbone_name) if table.reference_average else None,
    }
    if _text_suite(suite) is not None:  # a language-model suite (mergebench); glue8 is listed as CLIP's are
        return {**listing, **_describe_text_suite(suite, table)}
    single = single_model_reference(backbone_name)
    tasks = []
    for task in table.tasks.values():
        reference = {kind: single[kind][task.name] for kind in SINGLE_MODEL_KINDS if task.name in single[kind]}
        if task.text is None:  # every built-in table's task has its family's format (classes and templates)
            raise FeatcalError(f"Task {task.name!r} of suite {suite!r} has no classes or templates to list.")
        tasks.append(
            {
                "name": task.name,
                "dataset": task.dataset.path,
                "config": task.dataset.name,
                "train_split": task.dataset.train_split,
                "test_split": task.dataset.test_split,
                **task.text.listing(),
                "expert": task.expert,
                "reference_accuracy": {**reference, **task.reference_accuracy},
            }
        )
    data = suites_data()
    single_source = data["backbones"][backbone_name].get("single_model_reference_source", CLIP_SINGLE_SOURCE)
    return {
        **listing,
        "tasks": tasks,
        "single_model_reference_source": single_source,
        "source": {"repository": data["source"]["repository"], "commit": data["source"]["commit"]},
    }


def _describe_text_suite(suite: str, table: TaskTable) -> dict[str, Any]:
    """The language-model part of :func:`describe_suite`: tasks, merge settings, harness tasks, sources."""
    from featcal.tasks import format_columns

    lm_eval, not_run = suite_lm_eval(suite)
    tasks = []
    for task in table.tasks.values():
        fmt = task.text
        assert fmt is not None  # a language suite's tasks are text tasks
        tasks.append(
            {
                "name": task.name,
                "dataset": task.dataset.path,
                "config": task.dataset.name,
                "train_split": task.dataset.train_split,
                "columns": list(dict.fromkeys(format_columns(fmt, []))),
                "answer": fmt.answer,
                "expert": task.expert,
                "lm_eval": lm_eval.get(task.name, []),
                "not_run": not_run.get(task.name),
            }
        )
    source = (_text_suite(suite) or {})["source"]
    return {
        "tasks": tasks,
        "merge_defaults": {method: dict(params) for method, params in table.merge_defaults.items()},
        "featcal_settings": featcal_settings_source(suite),
        "source": {"repository": source["repository"], "commit": source["commit"], "models": source["models"]},
    }


def task_table(
    tasks_file: str | Path | None = None,
    *,
    replace: bool = False,
    suite: str | None = None,
    backbone: str | None = None,
) -> TaskTable:
    """The built-in table of ``suite`` on ``backbone``, extended (or replaced, with ``replace``) by a tasks file.

    Args:
        tasks_file: A JSON or YAML tasks file, or None for the built-in table alone.
        replace: Use the tasks file's table instead of the built-in one.
        suite: The built-in suite (``ta8``, ``ta14``, ``ta20``, ``mergebench``; see :mod:`featcal.suites`);
            None: ``ta8``.
        backbone: The backbone whose base and experts the built-in table names (``b32``, ``b16``, ``l14``
            for CLIP's suites; ``llama-3.2-3b``, ... for ``mergebench``); None: the suite's default.

    Raises:
        FeatcalError: for an invalid tasks file; ``UnknownNameError`` for an unknown suite or backbone.
    """
    from featcal.tasks import load_task_file

    builtin = suite_table(suite, backbone)
    if tasks_file is None:
        return builtin
    user = load_task_file(tasks_file)
    return user if replace else builtin.merged_with(user)
