"""Evaluation batch size on the CPU: `featcal evaluate` on the ViT-B/32 shape at several batch sizes,
each run a fresh process, the sizes alternating.

Inputs are ``ta8_rehearsal.py``'s (random ViT-B/32-shaped CLIP, experts, 224 px parquet datasets),
built in ``--workdir`` if missing; the model evaluated is Task Arithmetic κ 0.3 (``featcal merge``).
Per run: wall time, user and system CPU time and peak RSS (``wait4``). The result sets the CPU
default of ``--eval-batch-size`` (``featcal.evaluation.EVAL_BATCH_SIZE``).

    .venv/bin/python benchmarks/eval_batch_speed.py --workdir /tmp/featcal-eval-batch

Writes ``benchmarks/results/eval_batch_speed.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from allocator_speed import FEATCAL, RESULTS, prepare_inputs, run, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/featcal-eval-batch"))
    parser.add_argument("--tasks", nargs="+", default=["eurosat", "gtsrb", "mnist", "svhn"])
    parser.add_argument("--test-images", type=int, default=256, help="test images per task (default 256)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "eval_batch_speed.json")
    args = parser.parse_args()
    work = args.workdir.resolve()
    env, inputs, merged = prepare_inputs(
        work,
        args.tasks,
        merge_tasks=args.tasks,
        images=16,
        test_images=args.test_images,
        threads=args.threads,
        environ=dict(os.environ),
    )
    runs = []
    for repeat in range(args.repeats):
        for size in args.batch_sizes:
            cmd = [
                *FEATCAL, "evaluate", *inputs, "--tasks", *args.tasks, "--model", str(merged),
                "--eval-batch-size", str(size), "--eval-num-workers", "0", "--threads", str(args.threads),
                "--output", str(work / f"metrics-{size}.json"),
            ]  # fmt: skip
            load = os.getloadavg()
            result = run(cmd, env) | {"batch_size": size, "repeat": repeat}
            runs.append(result | {"load_average_before": [round(x, 2) for x in load]})
            print(json.dumps(runs[-1]), flush=True)
    accuracies = {
        size: json.loads((work / f"metrics-{size}.json").read_text())["average"]["accuracy"]
        for size in args.batch_sizes
    }
    write_report(
        args.out,
        __doc__,
        images={"tasks": args.tasks, "per_task": args.test_images},
        threads=args.threads,
        average_accuracy_by_batch_size=accuracies,
        runs=runs,
    )
    print("| batch | repeat | wall (s) | user (s) | system (s) | peak RSS (GiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['batch_size']} | {r['repeat']} | {r['wall_s']:.1f} | {r['user_s']:.1f} | {r['system_s']:.1f} | "
            f"{r['peak_rss_GiB']:.2f} |"
        )


if __name__ == "__main__":
    main()
