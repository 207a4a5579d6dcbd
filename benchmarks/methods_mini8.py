"""Each merging method alone and + FeatCal on the offline mini8 benchmark: accuracy per task.

    python benchmarks/methods_mini8.py [--methods task_arithmetic ties ...] [--tiny]
    python benchmarks/methods_mini8.py --methods --ta-grid 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 1.0 \
        --output benchmarks/results/methods_mini8_ta_grid.json

Writes benchmarks/results/methods_mini8.json and prints a markdown table (accuracy in %). With
``--ta-grid``, Task Arithmetic is also merged alone at each κ of the grid, and the best κ (highest
average) is run again + FeatCal: the "best-κ Task Arithmetic" rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from featcal.demo import ZooConfig, build_zoo, demo_run_spec
from featcal.merging import available_methods, get_method
from featcal.pipeline import run_pipeline
from featcal.runfolder.layout import calibrated_stage_name, merged_stage_name

RESULTS = Path(__file__).parent / "results" / "methods_mini8.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=available_methods())
    parser.add_argument("--ta-grid", nargs="+", type=float, default=[], metavar="K", help="Task Arithmetic κ grid")
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument(
        "--zoo-field", action="append", default=[], metavar="NAME=VALUE", help="a zoo variant (ZooConfig field)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = ZooConfig.tiny(args.zoo_seed) if args.tiny else ZooConfig.mini8(args.zoo_seed)
    zoo = build_zoo(preset.with_assignments(args.zoo_field))
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, method in enumerate(args.methods):
            spec = demo_run_spec(zoo, Path(tmp) / method, progress=False).replace(
                merge_method=method, merge_params={}, eval_zero_shot=i == 0, eval_experts=i == 0, no_export=True
            )
            start = time.perf_counter()
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            timings = json.loads((Path(tmp) / method / "timings.json").read_text())
            name, calibrated = merged_stage_name(method), calibrated_stage_name(method)
            rows[method] = {
                "merged": results[name],
                "featcal": results[calibrated],
                "params": get_method(method).resolved_params(),
                "timings": timings,
                "wall_s": time.perf_counter() - start,
            }
            if i == 0:
                rows["_zero_shot"], rows["_experts"] = results["zero-shot"], results["experts"]
            print(
                f"{method}: {100 * results[name]['average']['accuracy']:.2f} → "
                f"{100 * results[calibrated]['average']['accuracy']:.2f}",
                flush=True,
            )
        grid: dict[float, dict] = {}
        for kappa in args.ta_grid:
            first = "_experts" not in rows
            spec = demo_run_spec(zoo, Path(tmp) / f"ta-{kappa}", progress=False, scaling_factor=kappa).replace(
                skip_featcal=True, eval_zero_shot=first, eval_experts=first, no_export=True
            )
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            grid[kappa] = results[merged_stage_name("task_arithmetic")]
            if first:
                rows["_zero_shot"], rows["_experts"] = results["zero-shot"], results["experts"]
            print(f"task_arithmetic κ {kappa}: {100 * grid[kappa]['average']['accuracy']:.2f}", flush=True)
        if grid:
            best = max(grid, key=lambda k: grid[k]["average"]["accuracy"])
            spec = demo_run_spec(zoo, Path(tmp) / "ta-best", progress=False, scaling_factor=best).replace(
                no_export=True
            )
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            rows["_ta_grid"] = {str(k): v["average"]["accuracy"] for k, v in grid.items()}
            rows["task_arithmetic_best"] = {
                "merged": grid[best],
                "featcal": results[calibrated_stage_name("task_arithmetic")],
                "params": {"scaling_factor": best},
            }
    tasks = [k for k in rows["_experts"] if k not in {"average", "run_id", "model_info"}]
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "zoo": str(zoo),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"environment": env, "tasks": tasks, "rows": rows}, indent=1))
    acc = lambda report, t: f"{100 * report[t]['accuracy']:.1f}"  # noqa: E731
    print("| method | " + " | ".join(tasks) + " | average |")
    print("|---|" + "---:|" * (len(tasks) + 1))
    print("| zero-shot base | " + " | ".join(acc(rows["_zero_shot"], t) for t in [*tasks, "average"]) + " |")
    print("| experts (each on its task) | " + " | ".join(acc(rows["_experts"], t) for t in [*tasks, "average"]) + " |")
    labels = {m: m for m in args.methods}
    if "task_arithmetic_best" in rows:
        labels["task_arithmetic_best"] = (
            f"task_arithmetic (best κ {rows['task_arithmetic_best']['params']['scaling_factor']})"
        )
    for method, name in labels.items():
        for stage, label in (("merged", name), ("featcal", f"{name} + FeatCal")):
            print(f"| {label} | " + " | ".join(acc(rows[method][stage], t) for t in [*tasks, "average"]) + " |")


if __name__ == "__main__":
    main()
