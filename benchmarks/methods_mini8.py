"""Each merging method alone and + FeatCal on the offline mini8 benchmark: accuracy per task.

    python benchmarks/methods_mini8.py [--methods task_arithmetic ties ...] [--tiny]

Writes benchmarks/results/methods_mini8.json and prints a markdown table (accuracy in %).
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
from featcal.runfolder import calibrated_stage_name, merged_stage_name

RESULTS = Path(__file__).parent / "results" / "methods_mini8.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=available_methods())
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    zoo = build_zoo(ZooConfig.tiny() if args.tiny else ZooConfig.mini8())
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
    for method in args.methods:
        for stage, label in (("merged", method), ("featcal", f"{method} + FeatCal")):
            print(f"| {label} | " + " | ".join(acc(rows[method][stage], t) for t in [*tasks, "average"]) + " |")


if __name__ == "__main__":
    main()
