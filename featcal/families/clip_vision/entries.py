"""What an image task's entry says beyond the common fields: its class names and zero-shot prompt templates.

The task table (:mod:`featcal.tasks`) reads the common fields (dataset, expert, references) and hands the
rest of an entry of this family to :func:`parse_task_fields`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.errors import FeatcalError

TASK_FIELDS = frozenset({"classnames", "templates"})


def parse_task_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image task's class names and templates, checked.

    Args:
        entry: The task's entry in a tasks file.
        where: The entry named for messages (``task 'cars' in tasks.yaml``).

    Returns:
        ``classnames`` and ``templates`` of the :class:`~featcal.tasks.Task`, as tuples.

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
    return {"classnames": tuple(classnames), "templates": tuple(templates)}
