"""A FeatCal sweep over n calibrated together against one separate calibration per n.

On ViT-B/32-shaped random models (built by ``calibration_speed.build_models``: a random base,
experts = base + random task vectors, their Task Arithmetic merge; random pixels; nothing is
downloaded). Each way runs in a fresh subprocess, so its time and peak RSS (VmHWM) are its own; the
calibration only is timed (no evaluation), in wall-clock and in process CPU time (all threads), the
fairer measure on a machine shared with other jobs. The weights of the two ways are compared.

    .venv/bin/python benchmarks/sweep_speed.py                                  # 2 tasks, n = 8,16,32,64
    .venv/bin/python benchmarks/sweep_speed.py --tasks 8 --sizes 8,16,32,64,128,256   # the paper's curve

Writes ``benchmarks/results/sweep_speed.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibration_floor import RESULTS, environment
from calibration_speed import build_models

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _memory() -> dict[str, int]:
    status = Path("/proc/self/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM")}


def _calibrate(workdir: Path, tasks: int, sizes: list[int], way: str, threads: int, out: Path) -> dict:
    """Run one way in this process; save each n's weights to ``out`` and return time and memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionModel

    from featcal.calibration import FeatCalParams, featcal_calibrate
    from featcal.calibration.sweep import featcal_calibrate_many
    from featcal.families.clip_vision.folders import vision_checkpoint

    torch.set_num_threads(threads)
    base = vision_checkpoint(workdir / "base")
    experts = {f"t{i}": vision_checkpoint(workdir / "experts" / f"t{i}") for i in range(tasks)}
    merged = CLIPVisionModel.from_pretrained(str(workdir / "merged")).eval()
    generator = torch.Generator().manual_seed(0)
    pixels = {task: torch.randn(max(sizes), 3, 224, 224, generator=generator) for task in experts}
    settings = [FeatCalParams(num_calibration_examples=n) for n in sizes]
    start, cpu_start = time.perf_counter(), time.process_time()
    if way == "together":
        models = dict(featcal_calibrate_many(merged, base, experts, pixels.__getitem__, settings, progress=False))
    else:
        models = {
            i: featcal_calibrate(
                merged, base, experts, lambda task, n=p.num_calibration_examples: pixels[task][:n], p, progress=False
            )
            for i, p in enumerate(settings)
        }
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    for i, n in enumerate(sizes):
        save_file({k: v.contiguous() for k, v in models[i].state_dict().items()}, str(out / f"{way}-n{n}.safetensors"))
    return {"way": way, "seconds": seconds, "cpu_seconds": cpu_seconds, "memory": _memory()}


def _compare(out: Path, sizes: list[int]) -> dict[str, float]:
    """The largest |together − separate| over every tensor, per n (0.0: bit-identical)."""
    from safetensors.torch import load_file

    worst = {}
    for n in sizes:
        a, b = load_file(str(out / f"together-n{n}.safetensors")), load_file(str(out / f"separate-n{n}.safetensors"))
        worst[str(n)] = max(float((a[k] - b[k]).abs().max()) for k in a)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "featcal-calibration-speed"))
    parser.add_argument("--out", default=str(RESULTS / "sweep_speed.json"))
    parser.add_argument("--way", choices=("together", "separate"), help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.sizes.split(",")})
    workdir = Path(args.workdir)
    if args.way:
        result = _calibrate(workdir, args.tasks, sizes, args.way, args.threads, Path(args.weights))
        print(json.dumps(result))
        return 0
    workdir.mkdir(parents=True, exist_ok=True)
    build_models(workdir, args.tasks)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": str(args.threads)}
    runs = {}
    with tempfile.TemporaryDirectory() as weights:
        for way in ("together", "separate"):
            cmd = [sys.executable, __file__, "--way", way, "--weights", weights, "--tasks", str(args.tasks),
                   "--sizes", args.sizes, "--threads", str(args.threads), "--workdir", str(workdir)]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[way] = json.loads(done.stdout.strip().splitlines()[-1])
            run = runs[way]
            print(f"{way}: {run['seconds']:.1f} s, CPU {run['cpu_seconds']:.1f} s, peak RSS "
                  f"{run['memory']['VmHWM'] / 2**30:.2f} GiB")  # fmt: skip
        worst = _compare(Path(weights), sizes)
    result = {
        "setting": {"tasks": args.tasks, "sizes": sizes, "model": "ViT-B/32-shaped, random (calibration_speed.py)"},
        "environment": environment(args.threads),
        "together": runs["together"],
        "separate": runs["separate"],
        "speedup": runs["separate"]["seconds"] / runs["together"]["seconds"],
        "cpu_speedup": runs["separate"]["cpu_seconds"] / runs["together"]["cpu_seconds"],
        "max_abs_weight_difference": worst,
    }
    print(f"speed-up {result['speedup']:.2f}x (CPU {result['cpu_speedup']:.2f}x); largest difference: {worst}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
