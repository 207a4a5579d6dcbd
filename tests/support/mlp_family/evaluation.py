"""The test family's evaluation: accuracy and cross-entropy of each task's test vectors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.distributed import World
from featcal.metrics import MetricsReport, TaskMetrics, count_parameters
from featcal.tasks import Task
from tests.support.mlp_family.data import load_split, vectors
from tests.support.mlp_family.model import load_model


def evaluation_settings(spec: Any, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
    """Nothing beyond the test data and ``max_eval_samples``."""
    return {}


class MLPEvaluator:
    """Evaluates models of the base in ``base_folder`` on the test splits."""

    def __init__(
        self, base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
    ) -> None:
        self.base_folder, self.device = Path(base_folder), device

    def base_model(self) -> nn.Module:
        return load_model(self.base_folder)

    def prepare(self, tasks: Sequence[Task]) -> None:
        """Nothing to compute from the base."""

    def test_data(self, tasks: Sequence[Task], *, batch_size: int | None, num_workers: int, max_samples: int | None):
        data = {}
        for task in tasks:
            split = load_split(task, "test")
            rows = list(range(len(split) if max_samples is None else min(max_samples, len(split))))
            data[task.name] = (vectors(task, split, rows), torch.tensor([split[i]["label"] for i in rows]))
        return data

    def evaluate_task(self, model: nn.Module, task: Task, *, data: Any, progress: bool) -> TaskMetrics:
        x, y = data[task.name]
        with torch.no_grad():
            logits = model.to(self.device)(x.to(self.device)).float().cpu()
        loss = float(nn.functional.cross_entropy(logits, y))
        return TaskMetrics(float((logits.argmax(-1) == y).float().mean()), loss, len(y))

    def evaluate(self, model: nn.Module, tasks: Sequence[Task], *, data: Any, progress: bool) -> MetricsReport:
        results = {task.name: self.evaluate_task(model, task, data=data, progress=progress) for task in tasks}
        return MetricsReport.from_results(results, model_info=count_parameters(model))
