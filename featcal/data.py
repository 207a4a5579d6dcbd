"""Task datasets: one split of a Hub dataset or a local parquet folder, and the calibration subset's rows.

A task's dataset is a Hub dataset id or a local folder in the Hub's parquet layout; which one it is,
and whether the Hub may be asked, is decided by :mod:`featcal.hub`. What a family reads from a split's
rows (images and labels, texts) is the family's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from featcal.errors import DatasetInputError
from featcal.files.reading import check_utf8
from featcal.fingerprints import dataset_fingerprint
from featcal.hub.connection import OFFLINE_HINT, hub_reachable, is_offline
from featcal.hub.downloads import download_failure, gated_repo_message
from featcal.hub.refs import is_commit, is_hub_id, local_path
from featcal.hub.retries import retry_transient

if TYPE_CHECKING:
    from featcal.distributed import World
    from featcal.families.base import ModelFamily
    from featcal.spec import RunSpec
    from featcal.tasks import Task

logger = logging.getLogger(__name__)


def dataset_commit(dataset: Any) -> str | None:
    """The Hub commit a loaded split was read at, from the folder ``datasets`` caches it in
    (``<cache>/<namespace>___<name>/<config>/<version>/<commit>/``); None when it was not read from the Hub."""
    for entry in getattr(dataset, "cache_files", None) or []:
        parent = Path(entry.get("filename", "")).parent.name
        if is_commit(parent):
            return parent
    return None


# The files of a local dataset folder that ``datasets`` reads as text (its card's YAML header included).
DATASET_TEXT_SUFFIXES = frozenset({".json", ".jsonl", ".csv", ".tsv", ".txt", ".md", ".yaml", ".yml"})


def check_dataset_folder_text(folder: Path, task: str) -> None:
    """Refuse a local dataset folder holding a text file (:data:`DATASET_TEXT_SUFFIXES`) that is not UTF-8.

    Raises:
        InputError: naming the task, the file, the line and the byte.
    """
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if not hidden and path.suffix.lower() in DATASET_TEXT_SUFFIXES:
            check_utf8(path, f"Task {task!r}: the dataset file")


def load_dataset_split(path: str, split: str, *, name: str | None = None, task: str = "?", revision: str | None = None):
    """One split of a dataset, from a local parquet repo folder or a Hub id.

    A Hub dataset is asked for only when the Hub answers, or from the cache when ``HF_HUB_OFFLINE``
    is set; passing refusals of the Hub (429, 5xx) are retried (:func:`~featcal.hub.retry_transient`).
    A ``revision`` that is a full commit is checked against the commit read (:func:`dataset_commit`):
    offline, ``datasets`` serves the newest cached copy whatever revision is asked for.

    Args:
        path: A local dataset folder or a Hub dataset id.
        split: The split to load (``"train"``, ``"test"``).
        name: The dataset's configuration, if it has several.
        task: The task the dataset is for (carried by the errors).
        revision: The branch, tag or commit of a Hub dataset to read (default: ``main``).

    Returns:
        The split, a ``datasets.Dataset``.

    Raises:
        DatasetInputError: The folder does not exist, ``path`` is no Hub id, the Hub cannot be reached,
            the dataset is missing, gated or private, the split is missing, the download was refused or
            cut off, or the dataset cannot be loaded.
        InputError: a local folder holding a text file that is not UTF-8 (naming the file and line).
    """
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    local = local_path(path)
    if local is not None and not local.exists():
        raise DatasetInputError(task, path, f"Task {task!r}: the dataset folder {path} does not exist.")
    if local is None and not is_hub_id(path):
        raise DatasetInputError(
            task,
            path,
            f"Task {task!r}: the dataset {path!r} is neither an existing folder nor a Hub id ('namespace/name').",
        )
    if local is None and not is_offline() and not hub_reachable():
        # With HF_HUB_OFFLINE set, datasets can still serve a cached copy.
        raise DatasetInputError(
            task, path, f"Task {task!r}: cannot load dataset {path!r}: the Hub cannot be reached. {OFFLINE_HINT}"
        )

    if local is not None and revision is not None:
        raise DatasetInputError(
            task, path, f"Task {task!r}: the dataset folder {path} is local: a revision pins Hub datasets only."
        )

    if local is not None:
        check_dataset_folder_text(local, task)

    def load():
        if local is not None:
            return datasets.load_dataset(str(local), name, split=split)
        return datasets.load_dataset(path, name, split=split, revision=revision)

    try:
        dataset = load() if local is not None or is_offline() else retry_transient(load, what=f"dataset {path}")
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise DatasetInputError(
                task, path, f"Task {task!r}: dataset {path!r} has no split {split!r} ({exc})."
            ) from None
        raise DatasetInputError(task, path, f"Task {task!r}: cannot load dataset {path!r}: {exc}") from None
    except DatasetNotFoundError as exc:
        if "gated" in str(exc):
            message = gated_repo_message("dataset", path, repo_type="dataset")
        else:
            message = (
                f"The dataset {path!r} is not on the Hub, or not visible to you: check its id in the tasks file, "
                "or log in with `hf auth login` for a private or gated one."
            )
        raise DatasetInputError(task, path, f"Task {task!r}: {message}") from None
    except Exception as exc:
        if local is not None:  # nothing of the Hub's to blame or retry: the folder is not a parquet dataset
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatasetInputError(
                task,
                path,
                f"Task {task!r}: the dataset folder {path} does not load ({reason}): featcal reads a folder in "
                "the Hub's parquet layout (data/<split>-00000-of-00001.parquet, as `Dataset.to_parquet` writes) "
                "and never runs a dataset script.",
            ) from None
        if isinstance(exc, (FileNotFoundError, ConnectionError)):
            raise DatasetInputError(
                task, path, f"Task {task!r}: cannot load dataset {path!r}: {exc}. {OFFLINE_HINT}"
            ) from None
        message = download_failure(exc, "dataset", path, repo_type="dataset")
        if message is None:
            raise
        raise DatasetInputError(task, path, f"Task {task!r}: {message}") from None
    read = dataset_commit(dataset) if local is None else None
    if is_commit(revision) and read is not None and read != revision:
        raise DatasetInputError(
            task,
            path,
            f"Task {task!r}: the dataset {path!r} is pinned to commit {revision[:12]} but the cache holds commit "
            f"{read[:12]}: run once where the Hub is reachable to download the pinned one.",
        )
    return dataset


def calibration_indices(num_rows: int, n: int, seed: int) -> list[int]:
    """The first ``n`` rows of the split after one shuffle with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_rows, generator=generator)[:n].tolist()


def process_calibration_rows(task: Task, num_rows: int, n: int, seed: int, world: World, what: str) -> list[int]:
    """This process's part of a task's calibration draw: the first ``n`` of ``num_rows`` rows after one shuffle
    with ``seed`` (:func:`calibration_indices`), split contiguously over the processes under torchrun
    (:meth:`~featcal.distributed.World.part`). Every family draws its calibration examples so.

    Args:
        task: The task drawn from.
        num_rows: The rows of its calibration split.
        n: The examples asked for (all rows when there are fewer).
        seed: The shuffle's seed.
        world: The processes.
        what: What one example is called in the refusal, with its plural (``image(s)``).

    Returns:
        The row indices this process reads, in drawn order.

    Raises:
        DatasetInputError: when the draw has fewer examples than there are processes.
    """
    rows = calibration_indices(num_rows, n, seed)
    if len(rows) < world.size:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: its {len(rows)} calibration {what} cannot be split over {world.size} processes; "
            f"start at most {len(rows)} processes.",
        )
    return rows[world.part(len(rows))]


def held_out_indices(num_rows: int, skip: int, seed: int) -> list[int]:
    """The rows of the split after the first ``skip`` of the same shuffle as :func:`calibration_indices`: rows
    no calibration of ``skip`` (or fewer) examples with ``seed`` reads.

    Args:
        num_rows: The split's size.
        skip: The calibration's number of examples (its rows come first in the shuffle).
        seed: The shuffle's seed.

    Returns:
        The held-out rows, in shuffled order (empty when ``skip`` covers the split).
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_rows, generator=generator)[skip:].tolist()


def held_out_setting(spec: RunSpec, tasks: Sequence[Task] = ()) -> dict[str, Any]:
    """A run's ``held_out`` evaluation setting for the ``tasks`` whose evaluation reads the rows their calibration
    draws from (:meth:`~featcal.tasks.DatasetSpec.evaluates_calibration_rows`): the shuffle's seed, the
    calibration's rows that come first in it (:func:`held_out_indices` skips them), and those tasks; empty
    when there are none (the run's evaluation is then the test split's first rows, as it always was).

    Args:
        spec: The run's options (``seed``, ``num_calibration_examples``).
        tasks: The run's tasks (none: the setting is empty).

    Returns:
        ``{"held_out": {"seed": ..., "after": ..., "tasks": [...]}}``, or ``{}``.
    """
    shared = [task.name for task in tasks if task.dataset.evaluates_calibration_rows()]
    if not shared:
        return {}
    return {"held_out": {"seed": spec.seed, "after": spec.featcal.num_calibration_examples, "tasks": shared}}


def check_rows_left(task: Task, num_rows: int, after: int) -> None:
    """Refuse a task whose evaluation reads its calibration rows when none is left after the calibration's.

    Raises:
        DatasetInputError: naming the task, its rows and the fix.
    """
    if num_rows <= after:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: its calibration reads the rows it is evaluated on ({task.dataset.path}), and its "
            f"{num_rows} rows leave none after the {after} calibration rows: lower num_calibration_examples or "
            "give it a test split of its own.",
        )


def held_out_record(split: str, seed: int, after: int, count: int) -> dict[str, Any]:
    """Where a task's evaluated rows lie, as its results record it: positions ``after`` to ``after + count``
    (end excluded) of the ``seed`` shuffle of ``split``, whose first ``after`` the calibration reads."""
    return {"split": split, "seed": seed, "rows": [after, after + count]}


@dataclass
class DatasetFacts:
    """What validation learnt about the tasks' datasets: each split's identity, and the calibration
    images each task will use when its train split holds fewer than asked for."""

    fingerprints: dict[str, dict[str, str]]
    calibration_counts: dict[str, int]
    commits: dict[str, str] = field(default_factory=dict)  # task -> the Hub commit its dataset was read at
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)  # task -> what its family found in them


def validate_datasets(
    family: ModelFamily,
    tasks: list[Task],
    splits: tuple[str, ...] = ("train", "test"),
    *,
    calibration_examples: int | None = None,
    allow_fewer: bool = False,
    seed: int | None = None,
    preprocessor: Any = None,
    held_out_after: int | None = None,
) -> DatasetFacts:
    """Load each task's splits once, so a missing split or column, an example the family cannot read
    (a label outside the task's classes), or a train split smaller than ``calibration_examples`` fails
    before anything is written. With ``seed``, the calibration examples themselves (the first
    ``calibration_examples`` of the train split after one shuffle with ``seed``) are read too, so that a
    damaged one is named before the first stage is written; ``preprocessor`` (the base's) lets a family
    check what it makes of them (a text family: each text's tokens against its length limit). With
    ``held_out_after`` (the run's ``num_calibration_examples``), a task whose evaluation reads its calibration
    rows (:func:`held_out_setting`) must leave a row after that many to evaluate on.

    Raises:
        DatasetInputError: naming the task, the split and the fix.
    """
    fingerprints: dict[str, dict[str, str]] = {}
    fewer: dict[str, int] = {}
    commits: dict[str, str] = {}
    examples: dict[str, dict[str, Any]] = {}
    for task in tasks:
        for split in splits:
            dataset = family.load_split(task, split)
            family.check_split(task, dataset, split)
            if split == "test" and held_out_after is not None and task.dataset.evaluates_calibration_rows():
                check_rows_left(task, len(dataset), held_out_after)
            fingerprints.setdefault(task.name, {})[split] = dataset_fingerprint(dataset)
            commit = dataset_commit(dataset) if is_hub_id(task.dataset.path) else None
            if commit is not None:
                commits[task.name] = commit
            if split == "train" and calibration_examples is not None and len(dataset) < calibration_examples:
                if not allow_fewer:
                    raise DatasetInputError(
                        task.name,
                        task.dataset.path,
                        f"Task {task.name!r}: the train split of {task.dataset.path} has {len(dataset)} "
                        f"{family.noun}s, fewer than the {calibration_examples} calibration {family.noun}s asked for: "
                        "lower "
                        "`num_calibration_examples`, or set `allow_fewer_calibration_examples` to use them all.",
                    )
                fewer[task.name] = len(dataset)
            if split == "train" and calibration_examples is not None and seed is not None:
                rows = calibration_indices(len(dataset), calibration_examples, seed)
                facts = family.check_examples(task, dataset, split, rows, preprocessor)
                if facts:
                    examples[task.name] = dict(facts)
    return DatasetFacts(fingerprints, fewer, commits, examples)
