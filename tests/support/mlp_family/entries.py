"""The test family's task entries: the column of each row's vector and the number of classes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from featcal.errors import FeatcalError

TASK_FIELDS = frozenset({"features", "classes"})


@dataclass(frozen=True)
class VectorFormat:
    """How a row is read: its vector's column; the labels are ``0 .. classes - 1`` in ``label``."""

    features: str
    classes: int

    def to_dict(self) -> dict[str, Any]:
        """The entry's keys, as a tasks file writes them (and a run records them)."""
        return {"features": self.features, "classes": self.classes}


def parse_task_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The task's :class:`VectorFormat`.

    Raises:
        FeatcalError: for a column that is not a name or fewer than two classes.
    """
    features, classes = entry.get("features", "x"), entry.get("classes")
    if not isinstance(features, str) or not features:
        raise FeatcalError(f"{where}: 'features' must name the column of the vectors.")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise FeatcalError(f"{where}: 'classes' must be a whole number, at least 2, not {classes!r}.")
    return {"text": VectorFormat(features, classes)}
