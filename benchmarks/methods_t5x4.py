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

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from methods_lm5 import RESULTS, compare_methods, print_table

from featcal.demo.t5_tasks import T5_TASKS_BY_NAME, vocabulary
from featcal.demo.t5_training import PairBatches, greedy_exact_match, train_t5
from featcal.demo.t5_zoo import T5ZooConfig, build_t5_zoo, expert_rows, split_rows, t5_run_spec


def _exact_match(report: dict, tasks: tuple[str, ...]) -> dict[str, float]:
    per_task = {task: 100 * report[task]["accuracy"] for task in tasks}  # a seq2seq task's score: exact match
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=["task_arithmetic", "simple_average", "ties"])
    parser.add_argument("--ta-grid", nargs="*", type=float, default=[], metavar="K", help="Task Arithmetic κ grid")
    parser.add_argument("--multitask", action="store_true", help="also train and score the multi-task model")
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--zoo-field", action="append", default=[], metavar="NAME=VALUE", help="a zoo variant")
    parser.add_argument("--cache-dir", default=None, help="zoo cache folder (default: featcal's)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the zoo even if it is cached")
    parser.add_argument("--output", default=None, help="results JSON (default results/t5x4_seed<S>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = T5ZooConfig.tiny(args.zoo_seed) if args.tiny else T5ZooConfig.t5x4(args.zoo_seed)
    config = preset.with_assignments(args.zoo_field)
    start = time.perf_counter()
    zoo = build_t5_zoo(config, cache_dir=args.cache_dir, force=args.rebuild, progress=False)
    info = json.loads((zoo / "zoo.json").read_text())
    print(f"zoo {zoo} (built in {info['build_seconds']} s; this call {time.perf_counter() - start:.0f} s)")
    tasks = config.tasks
    out: dict = {"zoo": info, "platform": platform.platform()}
    out.update(compare_methods(zoo, tasks, t5_run_spec, _exact_match, methods=args.methods, ta_grid=args.ta_grid))
    if args.multitask:
        began = time.perf_counter()
        out["multitask"] = _multitask(zoo, config)
        out["multitask_seconds"] = time.perf_counter() - began
        print(f"multi-task: {out['multitask']['average']:.2f}", flush=True)
    path = Path(args.output or RESULTS / f"{config.name}_seed{config.seed}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out, tasks)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
