"""torch threads on small models: FeatCal calibration and evaluation with 1 thread against torch's default.

For each model (the tiny test fixture; the mini8 zoo when ``--zoo`` names a built one) and thread
count, a fresh subprocess merges (Task Arithmetic), calibrates (FeatCal, reference defaults) and
evaluates the merge zero-shot, timing the calibration and the evaluation. Thread counts alternate
(1, default, 1, default, …) so that both see the same machine. ``--busy N`` starts N busy-looping
processes for the length of the measurement: a shared machine, on purpose.

    .venv/bin/python benchmarks/threads_small_models.py --zoo ~/.cache/featcal/benchmark/mini8-v3-seed0
    .venv/bin/python benchmarks/threads_small_models.py --busy 1 --out benchmarks/results/threads_busy.json

Writes ``benchmarks/results/threads_small_models.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from calibration_floor import RESULTS, environment

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "tiny-clip-3task"


def _child(tasks_file: str, base: str | None, threads: int) -> None:
    """One measurement, printed as a JSON line: calibration and evaluation seconds."""
    import torch

    torch.set_num_threads(threads)
    from featcal.calibration import featcal_calibrate
    from featcal.devices import resolve_device
    from featcal.families.clip_vision.evaluation import ZeroShotClassifier, load_base_clip
    from featcal.families.clip_vision.folders import build_vision_model
    from featcal.families.clip_vision.images import calibration_pixels
    from featcal.pipeline import merge
    from featcal.resolve import resolve_inputs
    from featcal.spec import RunSpec

    spec = RunSpec(tasks_file=tasks_file, base_model_id=base, eval_num_workers=0, progress=False)
    inputs = resolve_inputs(spec)
    device = resolve_device("cpu")
    clip, tokenizer, processor = load_base_clip(inputs.base_folder)
    merged = build_vision_model(inputs, merge(inputs, "task_arithmetic", device))
    classifier = ZeroShotClassifier(clip, tokenizer, device)
    images = classifier.test_images(inputs.tasks, processor, batch_size=256, num_workers=0)
    classifier.keep_heads_only(inputs.tasks)
    start = time.perf_counter()
    by_name = {t.name: t for t in inputs.tasks}
    calibrated = featcal_calibrate(
        merged,
        inputs.base,
        inputs.experts,
        lambda name: calibration_pixels(by_name[name], processor, spec.featcal.num_calibration_examples, 42),
        spec.featcal,
        device=device,
        progress=False,
    )
    calibrate_s = time.perf_counter() - start
    start = time.perf_counter()
    classifier.evaluate(calibrated, inputs.tasks, progress=False, images=images)
    print(json.dumps({"calibrate_s": calibrate_s, "evaluate_s": time.perf_counter() - start}))


def _busy() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, help="a built mini8 zoo folder (tasks.json, base/, experts/)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run alongside")
    parser.add_argument("--out", type=Path, default=RESULTS / "threads_small_models.json")
    parser.add_argument("--child", nargs=3, metavar=("TASKS", "BASE", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tasks_file, base, threads = args.child
        _child(tasks_file, None if base == "-" else base, int(threads))
        return

    models = {"tiny fixture (hidden 64, 3 tasks x 12 images)": (FIXTURE / "tasks.json", FIXTURE / "base")}
    if args.zoo:
        models["mini8 (hidden 96, 8 tasks x 256 images)"] = (args.zoo / "tasks.json", args.zoo / "base")
    default_threads = os.cpu_count() or 1
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    rows, load_start = [], os.getloadavg()
    try:
        for name, (tasks_file, base) in models.items():
            for repeat in range(args.repeats):
                for threads in (1, default_threads):
                    cmd = [sys.executable, __file__, "--child", str(tasks_file), str(base), str(threads)]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    row = {"model": name, "threads": threads, "repeat": repeat, "load_average": os.getloadavg()[0]}
                    rows.append(row | json.loads(out.stdout.strip().splitlines()[-1]))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for process in busy:
            process.terminate()
    summary = {}
    for name in models:
        for threads in (1, default_threads):
            mine = [r for r in rows if r["model"] == name and r["threads"] == threads]
            summary[f"{name}, {threads} thread(s)"] = {
                "calibrate_s_best": min(r["calibrate_s"] for r in mine),
                "evaluate_s_best": min(r["evaluate_s"] for r in mine),
            }
    report = {
        "command": " ".join(["python", *sys.argv]),
        "environment": environment(default_threads) | {"load_average_start": load_start, "busy_processes": args.busy},
        "rows": rows,
        "best": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for key, value in summary.items():
        print(f"{key:<60} calibrate {value['calibrate_s_best']:.2f} s, evaluate {value['evaluate_s_best']:.2f} s")


if __name__ == "__main__":
    main()
