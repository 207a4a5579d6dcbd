"""What an image task's entry says beyond the common fields: its class names and zero-shot prompt templates.

The task table (:mod:`featcal.tasks`) reads the common fields (dataset, expert, references) and hands the
rest of an entry of this family to :func:`parse_task_fields`, which makes the task's :class:`ImageClasses`
(its ``text``, as a text family's format is). Modules outside the family read them through
:func:`image_classes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from featcal.errors import DatasetInputError, FeatcalError
from featcal.tasks import Task

TASK_FIELDS = frozenset({"classnames", "templates"})


@dataclass(frozen=True)
class ImageClasses:
    """An image task's classes and zero-shot prompts: the texts its zero-shot head is made of.

    Attributes:
        classnames: The names of the label column's class ids, in id order.
        templates: The prompt templates, each with one ``{}`` for a class name.
    """

    classnames: tuple[str, ...]
    templates: tuple[str, ...]

    def prompts(self, classname: str) -> list[str]:
        """The templates filled with one class name."""
        return [template.format(classname) for template in self.templates]

    def to_dict(self) -> dict[str, Any]:
        """The entry's keys, as a tasks file writes them (and a run records them)."""
        return {"classnames": list(self.classnames), "templates": list(self.templates)}

    def listing(self) -> dict[str, Any]:
        """What a suite's description says of the task (:func:`featcal.suites.describe_suite`): how many classes
        and templates."""
        return {"classes": len(self.classnames), "templates": len(self.templates)}


def image_classes(task: Task) -> ImageClasses:
    """The task's class names and templates.

    Args:
        task: An image task.

    Returns:
        Its :class:`ImageClasses`.

    Raises:
        DatasetInputError: for a task that has none (another family's).
    """
    if not isinstance(task.text, ImageClasses):
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r} is a {task.family} task, with no class names and prompt templates: give an image "
            "task ('classnames' and 'templates').",
        )
    return task.text


def parse_task_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image task's class names and templates, checked.

    Args:
        entry: The task's entry in a tasks file.
        where: The entry named for messages (``task 'cars' in tasks.yaml``).

    Returns:
        ``text``: the task's :class:`ImageClasses`.

    Raises:
        FeatcalError: for fewer than two class names, a repeated one, no templates, or a template without
            exactly one ``{}``.
    """
    classnames = entry.get("classnames")
    if not isinstance(classnames, list) or len(classnames) < 2 or not all(isinstance(c, str) for c in classnames):
        raise FeatcalError(f"{where}: 'classnames' must be a list of at least two strings.")
    repeated = sorted({c for c in classnames if classnames.count(c) > 1})
    if repeated:
        raise FeatcalError(
            f"{where}: 'classnames' names {', '.join(map(repr, repeated[:3]))} more than once; each class needs a "
            "name of its own (zero-shot heads of equal prompts cannot tell the classes apart)."
        )
    templates = entry.get("templates")
    if not isinstance(templates, list) or not templates or not all(isinstance(t, str) for t in templates):
        raise FeatcalError(f"{where}: 'templates' must be a non-empty list of strings.")
    for template in templates:
        if template.count("{}") != 1:
            raise FeatcalError(f"{where}: template {template!r} must contain exactly one '{{}}'.")
    return {"text": ImageClasses(tuple(classnames), tuple(templates))}
