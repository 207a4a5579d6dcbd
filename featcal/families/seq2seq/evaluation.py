"""The evaluation of T5 models as FusionBench measures FLAN-T5 on GLUE: greedy generations against the targets.

Each test input is generated from greedily (``max_length`` 10 tokens, the decoder's start token included) and
the generation decoded without special tokens. The target is decoded the same way from its tokens, so both
sides are the tokenizer's spelling. A task scores:

- ``exact_match``: the fraction of generations equal to their target (GLUE's classification tasks);
- ``spearman``: Spearman's ρ of the generations read as numbers against the targets (STS-B). A generation
  that does not read as a number (an empty one, or words) counts 0.0, as FusionBench's
  ``glue_evaluation.py`` counts it; it is kept, not dropped. Where every generation gives the same number ρ is
  undefined (FusionBench's scipy gives NaN); featcal reports 0.0.

Beside the score, each task reports the mean cross-entropy of its target tokens under teacher forcing.
Under torchrun each process generates for its part of every task's examples; counts and losses are summed
over the processes, and the numbers read for Spearman's ρ gathered.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.data import check_rows_left, held_out_indices, held_out_record
from featcal.distributed import SINGLE, World
from featcal.families.seq2seq.texts import base_tokenizer, encode_task_pairs, load_pair_split, pair_format, render_pair
from featcal.metrics import MetricsReport, TaskMetrics, count_parameters
from featcal.progress import Progress
from featcal.tasks import Task

GENERATION = {"max_length": 10, "do_sample": False, "num_beams": 1}  # FusionBench's model.generate(..., max_length=10)
logger = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 32  # FusionBench's GLUE evaluation batch


def read_number(text: str) -> float:
    """A generation read as a number: ``float(text)``, or 0.0 when it does not read as one (FusionBench's rule)."""
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def ranks(values: torch.Tensor) -> torch.Tensor:
    """The 1-based ranks of ``values`` (float64), tied values sharing their mean rank."""
    order = torch.argsort(values, stable=True)
    sorted_values = values[order]
    position = torch.arange(1, len(values) + 1, dtype=torch.float64)
    new_group = torch.ones(len(values), dtype=torch.bool)
    new_group[1:] = sorted_values[1:] != sorted_values[:-1]
    group = torch.cumsum(new_group, 0) - 1
    sums = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, position)
    counts = torch.zeros_like(sums).index_add_(0, group, torch.ones_like(position))
    out = torch.empty(len(values), dtype=torch.float64)
    out[order] = (sums / counts)[group]
    return out


def spearman(predictions: Sequence[float], targets: Sequence[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the ranks (ties share their mean rank); 0.0 where either side
    is constant (undefined) or there are fewer than two pairs."""
    if len(predictions) != len(targets):
        raise ValueError("spearman needs as many predictions as targets")
    if len(predictions) < 2:
        return 0.0
    a = ranks(torch.tensor(predictions, dtype=torch.float64))
    b = ranks(torch.tensor(targets, dtype=torch.float64))
    a, b = a - a.mean(), b - b.mean()
    norm = float(a.norm() * b.norm())
    return 0.0 if norm == 0.0 else float((a @ b) / norm)


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> int:
    """How many generations equal their target, string for string."""
    return sum(p == t for p, t in zip(predictions, targets, strict=True))


@dataclass(frozen=True)
class TaskPairs:
    """One task's test pairs, this process's part of them, how many the task has in all, and where they lie when
    they are held out of the calibration's rows (:func:`~featcal.data.held_out_record`; None: the test split's
    first rows)."""

    pairs: list[tuple[str, str]]
    total: int
    start: int
    held_out: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class TestPairs:
    """Every task's test pairs and the batch size they are generated in."""

    tasks: dict[str, TaskPairs]
    batch_size: int


class GenerationEvaluator:
    """The evaluation of T5 models of one base on seq2seq tasks (the :class:`~featcal.families.base.Evaluator`).

    Args:
        base_folder: The base model's folder (its tokenizer reads and writes every text).
        device: Where the models generate.
        world: The processes (each generates for its part of every task).
        held_out: The run's ``held_out`` evaluation setting (:func:`featcal.data.held_out_setting`), if any.
    """

    def __init__(
        self,
        base_folder: str | Path,
        device: torch.device | str,
        *,
        world: World = SINGLE,
        held_out: Mapping[str, Any] | None = None,
    ) -> None:
        self.base_folder = Path(base_folder)
        self.device = torch.device(device)
        self.world = world
        self.held_out = held_out
        self.tokenizer = base_tokenizer(self.base_folder)

    def base_model(self) -> nn.Module:
        from featcal.families.seq2seq.folders import load_t5_folder

        return load_t5_folder(self.base_folder)

    def prepare(self, tasks: Sequence[Task]) -> None:
        """Nothing to compute from the base: its tokenizer is all the evaluations read."""

    def test_data(
        self, tasks: Sequence[Task], *, batch_size: int | None, num_workers: int, max_samples: int | None
    ) -> TestPairs:
        """Each task's test pairs (its first ``max_samples``, or all), this process's part of them; for a task whose
        calibration reads its test split, the rows after the calibration's in the same shuffle instead.

        Raises:
            DatasetInputError: when such a task has no row left after the calibration's.
        """
        out = {}
        for task in tasks:
            rows = load_pair_split(task, "test")
            indices, record = self.test_rows(task, len(rows), max_samples)
            part = self.world.part(len(indices))
            pairs = [render_pair(task, rows[int(i)]) for i in indices[part.start : part.stop]]
            out[task.name] = TaskPairs(pairs, len(indices), part.start, record)
        return TestPairs(out, batch_size or DEFAULT_BATCH_SIZE)

    def test_rows(self, task: Task, num_rows: int, max_samples: int | None) -> tuple[list[int], dict[str, Any] | None]:
        """The rows of ``task``'s test split it is evaluated on, and where they lie when held out of the
        calibration's (None: the split's first rows), said in one line."""
        held_out = self.held_out
        if held_out is None or task.name not in held_out["tasks"]:
            return list(range(num_rows if max_samples is None else min(max_samples, num_rows))), None
        seed, after = int(held_out["seed"]), int(held_out["after"])
        check_rows_left(task, num_rows, after)
        indices = held_out_indices(num_rows, after, seed)[:max_samples]
        record = held_out_record(task.dataset.evaluated_split(), seed, after, len(indices))
        if self.world.is_main:
            logger.info(
                "Task %r: calibration reads positions 0-%d of the seed-%d shuffle of %s, evaluation positions %d-%d "
                "(held out of the calibration).",
                task.name, after - 1, seed, task.dataset.path, after, after + len(indices) - 1,
            )  # fmt: skip
        return indices, record

    def evaluate(self, model: nn.Module, tasks: Sequence[Task], *, data: TestPairs, progress: bool) -> MetricsReport:
        results = {task.name: self.evaluate_task(model, task, data=data, progress=progress) for task in tasks}
        return MetricsReport.from_results(results, model_info=count_parameters(model))

    @torch.no_grad()
    def generate(self, model: nn.Module, task: Task, pairs: Sequence[tuple[str, str]]) -> tuple[list[str], float, int]:
        """The generations for ``pairs``' inputs, decoded; the sum of their targets' token cross-entropies under
        teacher forcing, and the number of those tokens."""
        encoded = encode_task_pairs(task, self.tokenizer, pairs).batch
        input_ids = encoded.inputs["input_ids"].to(self.device)
        mask = encoded.context["attention_mask"].to(self.device)
        out = model.generate(input_ids=input_ids, attention_mask=mask, **GENERATION)
        texts = self.tokenizer.batch_decode(out, skip_special_tokens=True)
        labels = self.tokenizer([p[1] for p in pairs], truncation=True, max_length=pair_format(task).target_max_length,
                                padding="longest", return_tensors="pt")  # fmt: skip
        target = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100).to(self.device)
        logits = model(input_ids=input_ids, attention_mask=mask, labels=target).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum")
        return texts, float(loss), int(labels["attention_mask"].sum())

    def references(self, task: Task, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """The targets as the tokenizer spells them: their tokens (cut as the format cuts them) decoded."""
        limit = pair_format(task).target_max_length
        ids = self.tokenizer([p[1] for p in pairs], truncation=True, max_length=limit)["input_ids"]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def evaluate_task(self, model: nn.Module, task: Task, *, data: TestPairs, progress: bool) -> TaskMetrics:
        """``model``'s score on one task (exact match, or Spearman's ρ), its targets' mean cross-entropy, and the
        number of examples."""
        model = model.to(self.device).eval()
        own = data.tasks[task.name]
        generated: list[str] = []
        loss, tokens = 0.0, 0
        batches = range(0, len(own.pairs), data.batch_size)
        for start in Progress(batches, desc=f"Generating: {task.name}", unit="batches", leave=False,
                              enabled=progress and self.world.is_main):  # fmt: skip
            part = own.pairs[start : start + data.batch_size]
            texts, part_loss, part_tokens = self.generate(model, task, part)
            generated += texts
            loss += part_loss
            tokens += part_tokens
        references = self.references(task, own.pairs)
        fmt = pair_format(task)
        sums = torch.tensor([float(exact_match(generated, references)), loss, float(tokens)], dtype=torch.float64)
        if fmt.metric == "spearman":  # every process's numbers, in the tasks' order
            numbers = torch.zeros(2, own.total, dtype=torch.float64)
            numbers[0, own.start : own.start + len(generated)] = torch.tensor([read_number(t) for t in generated])
            numbers[1, own.start : own.start + len(references)] = torch.tensor([read_number(t) for t in references])
            self.world.all_reduce_sum_([sums, numbers], what="the evaluation")
            score = spearman(numbers[0].tolist(), numbers[1].tolist())
        else:
            self.world.all_reduce_sum_([sums], what="the evaluation")
            score = float(sums[0]) / own.total if own.total else 0.0
        extra = {"metric": fmt.metric, **({"held_out": dict(own.held_out)} if own.held_out else {})}
        return TaskMetrics(score, float(sums[1] / sums[2]) if sums[2] else math.nan, own.total, extra)
