"""One example image per task: shipped with the Space, or taken from the task's test split.

`featcal space push` fills ``examples/`` from each test split (streaming the first row of a Hub
dataset when the Hub answers); the app uses what ``examples/`` holds and takes any missing one from
a local dataset folder, never from the network at start-up.
"""

from __future__ import annotations

import logging
from pathlib import Path

from featcal.errors import DatasetInputError
from featcal.families.clip_vision.images import load_task_split, to_rgb
from featcal.hub.connection import hub_reachable, is_offline
from featcal.hub.refs import is_hub_id, local_path
from featcal.progress import Progress
from featcal.tasks import Task

logger = logging.getLogger(__name__)

EXAMPLE_SUFFIX = ".png"
MAX_EXAMPLE_SIDE = 512


def example_path(folder: Path, task: Task) -> Path:
    return folder / f"{task.name}{EXAMPLE_SUFFIX}"


def _first_test_image(task: Task, *, remote: bool):
    spec = task.dataset
    local = local_path(spec.path)
    if local is not None and local.is_dir():
        return load_task_split(task, "test")[0][spec.image_column]
    if not remote:
        return None
    if not is_hub_id(spec.path):
        raise DatasetInputError(task.name, spec.path, f"{spec.path!r} is neither a dataset folder nor a Hub dataset id")
    if is_offline() or not hub_reachable():
        raise DatasetInputError(task.name, spec.path, f"the Hub cannot be reached to read {spec.path!r}")
    import datasets

    rows = datasets.load_dataset(spec.path, spec.name, split=spec.test_split, streaming=True, revision=spec.revision)
    return next(iter(rows))[spec.image_column]


def collect_examples(
    tasks: list[Task], folder: Path, *, shipped: Path | None = None, remote: bool = False, progress: bool = True
) -> dict[str, Path]:
    """Per task, an example image: from ``shipped`` if it has one, else saved into ``folder`` from the test split.

    ``remote`` allows streaming Hub datasets. Tasks whose image cannot be had are left out, with a
    warning: examples are a convenience, never a reason not to start.
    """
    found: dict[str, Path] = {}
    for task in Progress(tasks, desc="Example images", unit="tasks", enabled=progress):
        if shipped is not None and example_path(shipped, task).is_file():
            found[task.name] = example_path(shipped, task)
            continue
        path = example_path(folder, task)
        if not path.is_file():
            try:
                image = _first_test_image(task, remote=remote)
            except Exception as exc:  # noqa: BLE001 - any failure (network, dataset, decoding) only costs the example
                logger.warning("No example image for task %s: %s", task.name, exc)
                continue
            if image is None:
                continue
            image = to_rgb(image)
            image.thumbnail((MAX_EXAMPLE_SIDE, MAX_EXAMPLE_SIDE))
            folder.mkdir(parents=True, exist_ok=True)
            image.save(path)
        found[task.name] = path
    return found
