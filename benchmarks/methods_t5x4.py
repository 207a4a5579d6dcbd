"""Merging methods alone and + FeatCal on the offline T5 benchmark t5x4: exact match per task.

    python benchmarks/methods_t5x4.py --zoo-seed 0 [--methods task_arithmetic simple_average ties]
        [--ta-grid 0.1 0.2 0.3 0.4 0.5 0.7 1.0] [--multitask] [--tiny] [--zoo-field NAME=VALUE ...]

Builds the zoo (or reads it from the cache; the build time is the one ``zoo.json`` records), runs
``featcal run``'s pipeline for each method (zero-shot base and experts evaluated once), Task Arithmetic
alone at each κ of ``--ta-grid``, and with ``--multitask`` fine-tunes one model from the base on all tasks
at once (the expert's steps times the number of tasks, the experts' frozen parts), the multi-task ceiling,
scored on the same test rows. Writes ``benchmarks/results/t5x4_seed<S>.json`` and prints a markdown table
(exact match in %, mean over the tasks).
"""

from __future__ import annotations

from pathlib import Path

from methods_lm5 import zoo_benchmark

from featcal.demo.t5_tasks import T5_TASKS_BY_NAME, vocabulary
from featcal.demo.t5_training import PairBatches, greedy_exact_match, train_t5
from featcal.demo.t5_zoo import T5ZooConfig, build_t5_zoo, expert_rows, split_rows, t5_run_spec
from featcal.metrics import task_score


def _exact_match(report: dict, tasks: tuple[str, ...]) -> dict[str, float]:
    per_task = {task: 100 * task_score(report[task]) for task in tasks}  # a seq2seq task's score: exact match
    return {**per_task, "average": sum(per_task.values()) / len(per_task)}


def _multitask(zoo: Path, config: T5ZooConfig) -> dict[str, float]:
    """One model fine-tuned from the base on every task at once, scored on the run's test rows."""
    from transformers import T5ForConditionalGeneration

    vocab = {word: i for i, word in enumerate(vocabulary())}
    tasks = [T5_TASKS_BY_NAME[name] for name in config.tasks]
    pairs = [task.pair(row) for task in tasks for row in expert_rows(task, config)]
    model = T5ForConditionalGeneration.from_pretrained(zoo / "base")
    train_t5(
        model, PairBatches(vocab, pairs), steps=config.expert_steps * len(config.tasks), batch_size=config.batch_size,
        lr=config.expert_lr, seed=config.seed, frozen=config.expert_frozen, desc="multi-task", progress=False,
    )  # fmt: skip
    scores = {}
    for task in tasks:
        test = [task.pair(row) for row in split_rows(task, config)["test"]]
        scores[task.name] = 100 * greedy_exact_match(model, vocab, test)
    return {**scores, "average": sum(scores.values()) / len(scores)}


def main() -> None:
    zoo_benchmark(
        __doc__.splitlines()[0], (T5ZooConfig.tiny, T5ZooConfig.t5x4), build_t5_zoo, t5_run_spec, _exact_match,
        _multitask, time_multitask=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
