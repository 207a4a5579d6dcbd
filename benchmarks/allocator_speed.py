"""glibc's allocator settings against glibc's defaults: `featcal calibrate` and `featcal evaluate` on the
ViT-B/32 shape, each run a fresh process, the settings alternating.

Settings compared (``featcal/allocator.py`` applies the second unless the environment sets glibc's
malloc options itself, which the first and third do):

- ``glibc defaults``: ``FEATCAL_ALLOCATOR=glibc``, so featcal leaves glibc's adaptive settings
  alone (setting any ``MALLOC_*_`` variable, even to its default value, would switch glibc's
  adaptive mmap threshold off);
- ``featcal``: no variable, the commands' settings (mmap threshold 32 MiB, trim threshold 2 GiB);
- ``heap up to 1 GiB``: ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647``.

Inputs are ``ta8_rehearsal.py``'s (random ViT-B/32-shaped CLIP, experts, 224 px parquet datasets),
built in ``--workdir`` if missing; the merge calibrated is Task Arithmetic κ 0.3 (``featcal merge``).
Per run: wall time, user and system CPU time, minor page faults and peak RSS (``wait4``).

    .venv/bin/python benchmarks/allocator_speed.py --workdir /tmp/featcal-allocator

Writes ``benchmarks/results/allocator_speed.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
FEATCAL = [sys.executable, "-m", "featcal", "-q"]
SETTINGS = {
    "glibc defaults": {"FEATCAL_ALLOCATOR": "glibc"},
    "featcal": {},
    "heap up to 1 GiB": {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "2147483647"},
}


def run(cmd: list[str], env: dict[str, str]) -> dict:
    """One fresh process: wall time and its ``wait4`` resource usage."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return {
        "wall_s": round(wall, 2),
        "user_s": round(usage.ru_utime, 2),
        "system_s": round(usage.ru_stime, 2),
        "minor_faults": usage.ru_minflt,
        "peak_rss_GiB": round(usage.ru_maxrss * 1024 / 2**30, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/featcal-allocator"))
    parser.add_argument("--calibrate-tasks", nargs="+", default=["eurosat", "mnist"])
    parser.add_argument("--images", type=int, default=64, help="calibration images per task (default 64)")
    parser.add_argument("--evaluate-tasks", nargs="+", default=["sun397", "eurosat", "svhn"])
    parser.add_argument("--test-images", type=int, default=256, help="test images per task (default 256)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "allocator_speed.json")
    args = parser.parse_args()
    work = args.workdir.resolve()
    drop = ("GLIBC_TUNABLES", "FEATCAL_ALLOCATOR")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in drop}
    env, inputs, merged = prepare_inputs(
        work,
        sorted(set(args.calibrate_tasks) | set(args.evaluate_tasks)),
        merge_tasks=args.calibrate_tasks,
        images=args.images,
        test_images=args.test_images,
        threads=args.threads,
        environ=environ,
    )
    commands = {
        "calibrate": [
            *FEATCAL, "calibrate", *inputs, "--tasks", *args.calibrate_tasks, "--merged", str(merged),
            "--num-calibration-examples", str(args.images), "--calibration-batch-size", "16",
            "--output", str(work / "calibrated"),
        ],
        "evaluate": [
            *FEATCAL, "evaluate", *inputs, "--tasks", *args.evaluate_tasks, "--model", str(merged),
            "--eval-batch-size", "256", "--eval-num-workers", "0", "--output", str(work / "metrics.json"),
        ],
    }  # fmt: skip
    runs = []
    for command, cmd in commands.items():
        for repeat in range(args.repeats):
            for setting, extra in SETTINGS.items():
                load = os.getloadavg()
                result = run(cmd, env | extra) | {"command": command, "setting": setting, "repeat": repeat}
                runs.append(result | {"load_average_before": [round(x, 2) for x in load]})
                print(json.dumps(runs[-1]), flush=True)
    write_report(
        args.out,
        __doc__,
        commands={k: " ".join(v[1:]).replace(str(work), "$WORKDIR") for k, v in commands.items()},
        settings=SETTINGS,
        threads=args.threads,
        runs=runs,
    )
    print("| command | setting | wall (s) | system (s) | minor faults | peak RSS (GiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['command']} | {r['setting']} | {r['wall_s']:.1f} | {r['system_s']:.1f} | "
            f"{r['minor_faults'] / 1e6:.2f} M | {r['peak_rss_GiB']:.2f} |"
        )


def prepare_inputs(
    work: Path,
    tasks: list[str],
    *,
    merge_tasks: list[str],
    images: int,
    test_images: int,
    threads: int,
    environ: dict[str, str],
) -> tuple[dict[str, str], list[str], Path]:
    """``ta8_rehearsal.py``'s inputs in ``work`` and their Task Arithmetic merge (κ 0.3) of ``merge_tasks``.

    Returns the environment of the measured commands (``environ`` plus the repository, the thread count
    and an offline Hub home in ``work``), the input flags every command takes, and the merged folder.
    """
    build = [sys.executable, str(HERE / "ta8_rehearsal.py"), "--build-only", str(work), "--tasks", *tasks]
    build += ["--images-per-task", str(images), "--test-images", str(test_images)]
    subprocess.run(build, check=True, stdout=subprocess.DEVNULL)
    env = environ | {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": str(threads),
        "HF_HOME": str(work / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    inputs = ["--tasks-file", str(work / "tasks.json"), "--base-model-id", str(work / "base"), "--device", "cpu"]
    merged = work / "ta"
    if not merged.is_dir():
        merge = [*FEATCAL, "merge", *inputs, "--tasks", *merge_tasks, "--output", str(merged)]
        subprocess.run(merge, env=env, check=True, stdout=subprocess.DEVNULL)
    return env, inputs, merged


def write_report(out: Path, doc: str, **fields) -> None:
    """Write a benchmark's JSON: its docstring's first line, the command that ran it, ``fields``, the CPU."""
    report = {"about": doc.splitlines()[0], "command": " ".join(["python", *sys.argv]), **fields, "cpu": cpu_name()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
