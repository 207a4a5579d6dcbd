"""What a T5 release's model card says beside featcal's own: each task's metric, and the usage snippet's input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.runfolder.reader import RunFolder
from featcal.tasks import Task, TextPairFormat

METRIC_NAMES = {"exact_match": "exact match", "spearman": "Spearman's ρ"}


def _format(task: Task) -> TextPairFormat | None:
    return task.text if isinstance(task.text, TextPairFormat) else None


def card_context(run: RunFolder) -> Mapping[str, Any]:
    """The card template's ``metrics`` (each task's metric, in words) and ``snippet`` (the first task's input
    template, to show what an input looks like)."""
    formats = {t.name: _format(t) for t in run.tasks}
    first = next(iter(run.tasks))
    shown = formats[first.name]
    return {
        "metrics": {
            name: METRIC_NAMES.get(fmt.metric, fmt.metric) if fmt else "accuracy" for name, fmt in formats.items()
        },
        "snippet": {"task": first.name, "input": shown.input if shown else "{text}"},
    }
