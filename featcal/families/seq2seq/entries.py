"""What a text-to-text task's entry says beyond the common fields: its input and target templates, its label
words and how its generations are scored.

The task table (:mod:`featcal.tasks`) reads the common fields and hands the rest of an entry of this family
to :func:`parse_task_fields`; a calibration data file (:mod:`featcal.data_file`) copies :data:`DATA_FILE`'s
keys of each expert's entry into its task.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from featcal.errors import FeatcalError
from featcal.families.base import DataFileEntries
from featcal.tasks import DEFAULT_INPUT_LENGTH, DEFAULT_TARGET_LENGTH, TextPairFormat

TASK_FIELDS = frozenset({"input", "target", "labels", "metric", "max_length", "target_max_length"})
METRICS = ("exact_match", "spearman")  # how a task scores its generations
# A data file's entry of this family (one that gives an input or a target): its templates, label words and metric;
# its lengths, which the file's top level may set for every entry.
DATA_FILE = DataFileEntries(
    keys=("input", "target", "labels", "metric"),
    defaults=("max_length", "target_max_length"),
    marks=("input", "target"),
)


def _length(entry: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise FeatcalError(f"{where}: {key!r} must be a whole number of tokens, at least 2, not {value!r}.")
    return value


def parse_task_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A text-to-text task's :class:`~featcal.tasks.TextPairFormat`, checked.

    Args:
        entry: The task's entry in a tasks file (or a data file's expert, as a task entry).
        where: The entry named for messages.

    Returns:
        ``text``: the task's pair format.

    Raises:
        FeatcalError: naming the entry, for a template that is not one, label words that are not words or not
            distinct, an unknown metric or a length that does not fit.
    """
    for key in ("input", "target"):
        value = entry.get(key)
        if not isinstance(value, str) or not value.strip():
            raise FeatcalError(
                f'{where}: {key!r} must be a template over the dataset\'s columns (e.g. input: "{{sentence}}", '
                'target: "{label}").'
            )
        try:
            list(string.Formatter().parse(value))
        except ValueError:
            raise FeatcalError(
                f"{where}: {key!r} is not a valid template: {value!r} (write '{{{{' for a literal brace)."
            ) from None
    labels = entry.get("labels", [])
    unquoted = (
        [word for word in labels if isinstance(word, (bool, int, float)) or word is None]
        if isinstance(labels, list)
        else []
    )
    if unquoted:
        raise FeatcalError(
            f"{where}: 'labels' must list words, but the file gives {unquoted!r}, {type(unquoted[0]).__name__} values "
            "(YAML reads unquoted yes, no, true, off, numbers and null so): quote each word, e.g. "
            'labels: ["yes", "no"].'
        )
    if not isinstance(labels, list) or not all(isinstance(word, str) and word.strip() for word in labels):
        raise FeatcalError(f"{where}: 'labels' must list the words of the class ids, in id order.")
    if labels and (len(labels) < 2 or len(set(labels)) != len(labels)):
        raise FeatcalError(f"{where}: 'labels' must name at least two classes, each with a word of its own.")
    metric = entry.get("metric", METRICS[0])
    if metric not in METRICS:
        raise FeatcalError(f"{where}: 'metric' must be one of {', '.join(METRICS)}, not {metric!r}.")
    pair = TextPairFormat(
        entry["input"], entry["target"], tuple(labels), metric,
        _length(entry, "max_length", DEFAULT_INPUT_LENGTH, where),
        _length(entry, "target_max_length", DEFAULT_TARGET_LENGTH, where),
    )  # fmt: skip
    return {"text": pair}
