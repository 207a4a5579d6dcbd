"""Built-in task suites (``ta8``, ``ta14``, ``ta20``) and CLIP backbones (``b32``, ``b16``, ``l14``).

FusionBench's standard CLIP benchmark merges experts of three backbones on 8, 14 and 20 tasks.
``featcal/resources/suites.json`` says which tasks form each suite, which base and expert ids each
backbone has, and the accuracies FusionBench publishes; the tasks themselves are described once, the
eight TA8 tasks in ``ta8_tasks.json`` and the twelve others in ``tall_tasks.json``. Both files name
the FusionBench files (and commit) their facts come from.

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

from featcal.errors import UnknownNameError

if TYPE_CHECKING:
    from pathlib import Path

    from featcal.tasks import TaskTable

SUITES_RESOURCE = "suites.json"
TALL_TABLE = "tall_tasks.json"
SINGLE_MODEL_KINDS = ("zero_shot", "expert")


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


@dataclass(frozen=True)
class Backbone:
    """A CLIP backbone: its title, base model id and the pattern of its experts' ids (with ``{task}``)."""

    name: str
    title: str
    base_model: str
    expert_model_pattern: str

    def expert(self, task: str) -> str:
        """The id of this backbone's expert for ``task``."""
        return self.expert_model_pattern.format(task=task)


def backbone(name: str) -> Backbone:
    """The backbone called ``name`` (``b32``, ``b16``, ``l14``).

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
        task's own expert on its task. Accuracies are fractions.
    """
    backbone(backbone_name)
    return {k: dict(v) for k, v in suites_data()["reference_accuracy"]["single_model"][backbone_name].items()}


def merged_reference(suite: str, backbone_name: str) -> dict[str, dict[str, float]]:
    """Published merge accuracies for ``suite`` on ``backbone_name``, by method then task (and ``average``).

    The CLIP ViT-B/32 TA8 numbers are the FeatCal reference run's (``ta8_tasks.json``); the others
    FusionBench's. Empty where nothing is published (FusionBench gives no per-task merge accuracies
    for 14 or 20 tasks).

    Raises:
        UnknownNameError: for a suite or backbone that is not built in.
    """
    suite_task_names(suite)
    backbone(backbone_name)
    if (suite, backbone_name) == (DEFAULT_SUITE, DEFAULT_BACKBONE):
        return _ta8_reference()
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
    title, count = backbone(backbone_name).title, len(suite_task_names(suite))
    return f"FusionBench (docs/modelpool/clip_vit.md, {title}, {count} tasks)"


def suite_table(suite: str | None = None, backbone_name: str | None = None) -> TaskTable:
    """The built-in task table of ``suite`` with ``backbone_name``'s base model and experts.

    Each task's ``reference_accuracy`` holds the merge accuracies published for this suite and
    backbone (none for most: see :func:`merged_reference`), with their source in ``reference_source``.
    ``ta8`` on ``b32`` is the TA8 table exactly as shipped.

    Args:
        suite: ``ta8``, ``ta14`` or ``ta20``; None: :data:`DEFAULT_SUITE`.
        backbone_name: ``b32``, ``b16`` or ``l14``; None: :data:`DEFAULT_BACKBONE`.

    Raises:
        UnknownNameError: for a suite or backbone that is not built in.
    """
    from featcal.tasks import builtin_tasks, parse_task_table

    suite, backbone_name = suite or DEFAULT_SUITE, backbone_name or DEFAULT_BACKBONE
    names = suite_task_names(suite)
    model = backbone(backbone_name)
    ta8 = builtin_tasks()
    if (suite, backbone_name) == (DEFAULT_SUITE, DEFAULT_BACKBONE):
        return ta8
    tall = parse_task_table(_resource(TALL_TABLE), source="built-in TALL tasks")
    known = {**ta8.tasks, **tall.tasks}
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
        suite: ``ta8``, ``ta14`` or ``ta20``; None: :data:`DEFAULT_SUITE`.
        backbone_name: ``b32``, ``b16`` or ``l14``; None: :data:`DEFAULT_BACKBONE`.

    Returns:
        A JSON-able mapping: the suite, backbone, base and expert pattern; per task its dataset id,
        configuration, splits, number of classes and templates, expert id and reference accuracies
        (``zero_shot`` and ``expert`` from FusionBench, and each merging method's where published);
        the published merge averages; and where the numbers come from.

    Raises:
        UnknownNameError: for a suite or backbone that is not built in.
    """
    suite, backbone_name = suite or DEFAULT_SUITE, backbone_name or DEFAULT_BACKBONE
    table = suite_table(suite, backbone_name)
    model = backbone(backbone_name)
    single = single_model_reference(backbone_name)
    tasks = []
    for task in table.tasks.values():
        reference = {kind: single[kind][task.name] for kind in SINGLE_MODEL_KINDS if task.name in single[kind]}
        tasks.append(
            {
                "name": task.name,
                "dataset": task.dataset.path,
                "config": task.dataset.name,
                "train_split": task.dataset.train_split,
                "test_split": task.dataset.test_split,
                "classes": len(task.classnames),
                "templates": len(task.templates),
                "expert": task.expert,
                "reference_accuracy": {**reference, **task.reference_accuracy},
            }
        )
    data = suites_data()
    return {
        "suite": suite,
        "title": suite_title(suite),
        "backbone": backbone_name,
        "backbone_title": model.title,
        "base_model": model.base_model,
        "expert_model_pattern": model.expert_model_pattern,
        "tasks": tasks,
        "reference_average": dict(table.reference_average),
        "merged_reference_source": reference_source(suite, backbone_name) if table.reference_average else None,
        "single_model_reference_source": "FusionBench (docs/modelpool/clip_vit.md, 'The 20-Task Model Collections')",
        "source": {"repository": data["source"]["repository"], "commit": data["source"]["commit"]},
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
        suite: The built-in suite (``ta8``, ``ta14``, ``ta20``; see :mod:`featcal.suites`); None: ``ta8``.
        backbone: The CLIP backbone whose base and experts the built-in table names (``b32``, ``b16``,
            ``l14``); None: ``b32``.

    Raises:
        FeatcalError: for an invalid tasks file; ``UnknownNameError`` for an unknown suite or backbone.
    """
    from featcal.tasks import load_task_file

    builtin = suite_table(suite, backbone)
    if tasks_file is None:
        return builtin
    user = load_task_file(tasks_file)
    return user if replace else builtin.merged_with(user)
