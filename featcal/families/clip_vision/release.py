"""What a CLIP release's model card says beside featcal's own: each task's number of classes, and the usage
snippet's task, classes and prompts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.families.clip_vision.entries import image_classes
from featcal.hub.refs import is_hub_id
from featcal.runfolder.reader import RunFolder
from featcal.tasks import Task


def _snippet_task(tasks: tuple[Task, ...]) -> Task:
    """The task shown in the usage snippet: a Hub dataset when there is one, with the fewest classes."""
    candidates = [t for t in tasks if is_hub_id(t.dataset.path)] or list(tasks)
    return min(candidates, key=lambda t: len(image_classes(t).classnames))


def card_context(run: RunFolder) -> Mapping[str, Any]:
    """The card template's ``classes`` (task name -> its number of classes) and ``snippet``: a task of the run
    to classify one image of, zero-shot."""
    snippet = _snippet_task(run.tasks)
    return {
        "classes": {t.name: len(image_classes(t).classnames) for t in run.tasks},
        "snippet": {
            "task": snippet.name,
            **image_classes(snippet).to_dict(),
            # None when no task has a Hub dataset: the snippet then opens an image file instead
            "dataset": snippet.dataset.path if is_hub_id(snippet.dataset.path) else None,
            "config": snippet.dataset.name,
            "split": snippet.dataset.test_split,
            "image_column": snippet.dataset.image_column,
        },
    }
