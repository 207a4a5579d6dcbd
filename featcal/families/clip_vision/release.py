"""What a CLIP release's model card says beside featcal's own: the usage snippet's task, classes and prompts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.hub.refs import is_hub_id
from featcal.runfolder.reader import RunFolder
from featcal.tasks import Task


def _snippet_task(tasks: tuple[Task, ...]) -> Task:
    """The task shown in the usage snippet: a Hub dataset when there is one, with the fewest classes."""
    candidates = [t for t in tasks if is_hub_id(t.dataset.path)] or list(tasks)
    return min(candidates, key=lambda t: len(t.classnames))


def card_context(run: RunFolder) -> Mapping[str, Any]:
    """The card template's ``snippet``: a task of the run to classify one image of, zero-shot."""
    snippet = _snippet_task(run.tasks)
    return {
        "snippet": {
            "task": snippet.name,
            "classnames": list(snippet.classnames),
            "templates": list(snippet.templates),
            # None when no task has a Hub dataset: the snippet then opens an image file instead
            "dataset": snippet.dataset.path if is_hub_id(snippet.dataset.path) else None,
            "config": snippet.dataset.name,
            "split": snippet.dataset.test_split,
            "image_column": snippet.dataset.image_column,
        }
    }
