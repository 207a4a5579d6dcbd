"""The test family's data: each task's splits from a local parquet folder, its rows' vectors and labels."""

from __future__ import annotations

from typing import Any

import torch

from featcal.calibration.adapters import CalibrationBatch
from featcal.data import load_dataset_split, process_calibration_rows
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError
from featcal.tasks import Task
from tests.support.mlp_family.adapter import VECTORS


def preprocessor(base_folder: Any) -> None:
    """Vectors need none."""
    return None


def load_split(task: Task, split: str) -> Any:
    name = task.dataset.train_split if split == "train" else task.dataset.test_split
    return load_dataset_split(task.dataset.path, name, task=task.name)


def check_split(task: Task, dataset: Any, split: str) -> None:
    """Refuse a label outside the task's classes."""
    if any(not 0 <= label < task.text.classes for label in dataset["label"]):
        raise DatasetInputError(task.name, task.dataset.path, f"Task {task.name!r}: a {split} label is out of range.")


def vectors(task: Task, dataset: Any, rows: list[int]) -> torch.Tensor:
    return torch.tensor([dataset[int(i)][task.text.features] for i in rows], dtype=torch.float32)


def calibration_inputs(task: Task, preprocessor: Any, n: int, seed: int, *, world: World = SINGLE) -> CalibrationBatch:
    dataset = load_split(task, "train")
    rows = process_calibration_rows(task, len(dataset), n, seed, world, "vector(s)")
    return CalibrationBatch({VECTORS: vectors(task, dataset, rows)})


def test_inputs(task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
    dataset = load_split(task, "test")
    return CalibrationBatch({VECTORS: vectors(task, dataset, list(range(min(n, len(dataset)))))})
