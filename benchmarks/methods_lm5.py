"""Merging methods alone and + FeatCal on the offline language-model benchmark lm5: exact match per task.

    python benchmarks/methods_lm5.py --zoo-seed 0 [--methods task_arithmetic simple_average ties]
        [--ta-grid 0.2 0.3 0.4 0.5 0.7 1.0] [--multitask] [--tiny] [--zoo-field NAME=VALUE ...]

Builds the zoo (or reads it from the cache; the build time is the one ``zoo.json`` records), runs
``featcal run``'s pipeline for each method (zero-shot base and experts evaluated once), Task Arithmetic
alone at each κ of ``--ta-grid``, and with ``--multitask`` fine-tunes one model from the base on all tasks
at once (the expert's steps times the number of tasks), the multi-task ceiling, scored on the same
held-out rows. Writes ``benchmarks/results/lm5_seed<S>.json`` and prints a markdown table (exact match
in %, mean over the tasks).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from featcal.data import held_out_indices
from featcal.demo.lm_tasks import TASKS_BY_NAME, substitution, task_rows, vocabulary
from featcal.demo.lm_training import TextBatches, greedy_exact_match, train_lm
from featcal.demo.lm_zoo import LM_CALIBRATION_EXAMPLES, LM_MAX_NEW_TOKENS, LMZooConfig, build_lm_zoo, lm_run_spec
from featcal.pipeline import run_pipeline
from featcal.runfolder.layout import calibrated_stage_name, merged_stage_name
from featcal.spec import RunSpec

RESULTS = Path(__file__).parent / "results"


def _exact_match(report: dict, tasks: tuple[str, ...]) -> dict[str, float]:
    per_task = {task: 100 * report[task]["exact_match"] for task in tasks}
    return {**per_task, "average": sum(per_task.values()) / len(per_task)}


def _multitask(zoo: Path, config: LMZooConfig, seed: int) -> dict[str, float]:
    """One model fine-tuned from the base on every task at once, scored on the run's held-out rows."""
    from transformers import LlamaForCausalLM

    vocab = {word: i for i, word in enumerate(vocabulary())}
    cipher = substitution(config.seed)
    pairs = []
    for task in config.tasks:
        rows = task_rows(TASKS_BY_NAME[task], random.Random(f"train-{config.seed}-{task}"), config.train_rows,
                         cipher, config.min_len, config.max_len)  # fmt: skip
        pairs += [(r["prompt"], r["answer"]) for r in rows]
    model = LlamaForCausalLM.from_pretrained(zoo / "base")
    train_lm(
        model, TextBatches(vocab, pairs, responses_only=True, end_of_text=True),
        steps=config.expert_steps * len(config.tasks), batch_size=config.batch_size, lr=config.expert_lr,
        seed=config.seed, frozen=config.expert_frozen, desc="multi-task", progress=False,
    )  # fmt: skip
    scores = {}
    for task in config.tasks:
        rows = [json.loads(line) for line in (zoo / "data" / f"{task}.jsonl").read_text().splitlines()]
        held = [rows[int(i)] for i in held_out_indices(len(rows), LM_CALIBRATION_EXAMPLES, seed)]
        scores[task] = 100 * greedy_exact_match(model, vocab, held, max_new_tokens=LM_MAX_NEW_TOKENS)
    return {**scores, "average": sum(scores.values()) / len(scores)}


def compare_methods(
    zoo: Path,
    tasks: tuple[str, ...],
    make_spec: Callable[..., RunSpec],
    score: Callable[[dict, tuple[str, ...]], dict[str, float]],
    *,
    methods: Sequence[str],
    ta_grid: Sequence[float],
) -> dict:
    """Each method alone and + FeatCal, then Task Arithmetic alone at each κ of ``ta_grid``, on a zoo.

    Args:
        zoo: The zoo's folder.
        tasks: Its tasks.
        make_spec: The zoo's run spec (``lm_run_spec``'s signature).
        score: A stage's scores per task and their average, in %, from its ``metrics.json`` entries.
        methods: The merging methods; the first run also evaluates the zero-shot base and the experts.
        ta_grid: Task Arithmetic's κ values.

    Returns:
        ``zero_shot``, ``experts``, ``run_seconds`` (the first run's), ``methods`` and ``ta_grid``.
    """
    out: dict = {"methods": {}, "ta_grid": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, method in enumerate(methods):
            spec = make_spec(zoo, Path(tmp) / method, progress=False, merge_method=method).replace(
                no_export=True, threads=1, eval_zero_shot=i == 0, eval_experts=i == 0
            )
            began = time.perf_counter()
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            if i == 0:
                out["zero_shot"] = score(results["zero-shot"], tasks)
                out["experts"] = score(results["experts"], tasks)
                out["run_seconds"] = time.perf_counter() - began
            out["methods"][method] = {
                "merged": score(results[merged_stage_name(method)], tasks),
                "featcal": score(results[calibrated_stage_name(method)], tasks),
                "params": spec.method_params(),
            }
            row = out["methods"][method]
            print(f"{method}: {row['merged']['average']:.2f} -> {row['featcal']['average']:.2f}", flush=True)
        for kappa in ta_grid:
            spec = make_spec(zoo, Path(tmp) / f"ta-{kappa}", progress=False, scaling_factor=kappa).replace(
                no_export=True, threads=1, skip_featcal=True
            )
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            out["ta_grid"][str(kappa)] = score(results[merged_stage_name("task_arithmetic")], tasks)
            print(f"TA κ {kappa}: {out['ta_grid'][str(kappa)]['average']:.2f}", flush=True)
    return out


def print_table(out: dict, tasks: tuple[str, ...]) -> None:
    """The results of :func:`compare_methods` (and the multi-task model's, when there) as a markdown table."""
    rows = [("base (zero-shot)", out["zero_shot"]), ("experts", out["experts"])]
    for method, row in out["methods"].items():
        rows += [(method, row["merged"]), (f"{method} + FeatCal", row["featcal"])]
    rows += [(f"TA κ {k}", v) for k, v in out["ta_grid"].items()]
    if "multitask" in out:
        rows.append(("multi-task model", out["multitask"]))
    print("| model | " + " | ".join(tasks) + " | average |\n|---|" + "---|" * (len(tasks) + 1))
    for name, values in rows:
        print(f"| {name} | " + " | ".join(f"{values[t]:.2f}" for t in (*tasks, "average")) + " |")


def zoo_benchmark(
    description: str,
    presets: tuple[Callable[[int], Any], Callable[[int], Any]],
    build: Callable[..., Path],
    run_spec: Callable[..., Any],
    exact_match: Callable[[dict, tuple[str, ...]], dict[str, float]],
    multitask: Callable[[Path, Any], dict[str, float]],
    *,
    time_multitask: bool = False,
) -> None:
    """The command line of a zoo's method comparison (this script's and ``methods_t5x4.py``'s): build or read
    the zoo, compare the methods, optionally train the multi-task model, write the results JSON, print the table.

    Args:
        description: The ``--help`` line.
        presets: The zoo's reduced and full configurations, by seed (``--tiny`` picks the first).
        build: Builds (or finds in the cache) a zoo: ``build(config, cache_dir=, force=, progress=)``.
        run_spec: The zoo's run spec (:func:`compare_methods`).
        exact_match: A metrics report's exact match per task and on average, in %.
        multitask: The multi-task model's scores, from the zoo and its configuration.
        time_multitask: Also record the multi-task model's seconds (``multitask_seconds``).
    """
    tiny, full = presets
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--methods", nargs="*", default=["task_arithmetic", "simple_average", "ties"])
    parser.add_argument("--ta-grid", nargs="*", type=float, default=[], metavar="K", help="Task Arithmetic κ grid")
    parser.add_argument("--multitask", action="store_true", help="also train and score the multi-task model")
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--zoo-field", action="append", default=[], metavar="NAME=VALUE", help="a zoo variant")
    parser.add_argument("--cache-dir", default=None, help="zoo cache folder (default: featcal's)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the zoo even if it is cached")
    parser.add_argument("--output", default=None, help=f"results JSON (default results/{full(0).name}_seed<S>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = (tiny if args.tiny else full)(args.zoo_seed).with_assignments(args.zoo_field)
    start = time.perf_counter()
    zoo = build(config, cache_dir=args.cache_dir, force=args.rebuild, progress=False)
    info = json.loads((zoo / "zoo.json").read_text())
    print(f"zoo {zoo} (built in {info['build_seconds']} s; this call {time.perf_counter() - start:.0f} s)")
    tasks = config.tasks
    out: dict = {"zoo": info, "platform": platform.platform()}
    out.update(compare_methods(zoo, tasks, run_spec, exact_match, methods=args.methods, ta_grid=args.ta_grid))
    if args.multitask:
        began = time.perf_counter()
        out["multitask"] = multitask(zoo, config)
        if time_multitask:
            out["multitask_seconds"] = time.perf_counter() - began
        print(f"multi-task: {out['multitask']['average']:.2f}", flush=True)
    path = Path(args.output or RESULTS / f"{config.name}_seed{config.seed}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out, tasks)
    print(f"wrote {path}")


def main() -> None:
    zoo_benchmark(
        __doc__.splitlines()[0], (LMZooConfig.tiny, LMZooConfig.lm5), build_lm_zoo, lm_run_spec, _exact_match,
        lambda zoo, config: _multitask(zoo, config, seed=42),
    )  # fmt: skip


if __name__ == "__main__":
    main()
