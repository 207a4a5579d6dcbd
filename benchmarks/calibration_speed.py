"""FeatCal calibration speed and memory on ViT-B/32-shaped random models, for a grid of tasks × images.

Builds a random ViT-B/32 vision tower (``CLIPVisionConfig()`` defaults) as the base, experts = base +
random task vectors and their Task Arithmetic merge (κ = 0.3), all saved as ``CLIPVisionModel``
safetensors folders in a work folder; calibration images are random pixel tensors. Nothing is
downloaded. Each point runs in a fresh subprocess, so its peak RSS (VmHWM) is its own.

    .venv/bin/python benchmarks/calibration_speed.py                      # the default points, ~10 min
    .venv/bin/python benchmarks/calibration_speed.py --points 8x256       # one point
    .venv/bin/python benchmarks/calibration_speed.py --reference --points 1x8   # plain implementation too
    .venv/bin/python benchmarks/calibration_speed.py --baseline-root /tmp/old --baseline-label old  # interleaved

Writes ``benchmarks/results/calibration_speed.json`` (``--out``) and a Markdown table beside it.
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

from calibration_floor import RESULTS, ViTShape, count_work, environment

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TASK_VECTOR_SCALE = 0.05  # task vector entries: this × the tensor's std × N(0, 1)
DEFAULT_POINTS = ["2x8", "2x16", "2x32", "2x64", "1x16", "4x16", "8x16"]  # images at 2 tasks, tasks at 16 images


# -- the models ------------------------------------------------------------------------------
def build_models(workdir: Path, tasks: int, seed: int = 0) -> None:
    """base/, experts/t0.., merged/ (Task Arithmetic over the experts) as CLIPVisionModel folders."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    if (workdir / "merged" / "config.json").is_file() and all(
        (workdir / "experts" / f"t{i}" / "config.json").is_file() for i in range(tasks)
    ):
        return
    torch.manual_seed(seed)
    model = CLIPVisionModel(CLIPVisionConfig()).eval()
    model.save_pretrained(workdir / "base")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    merged = {k: v.clone() for k, v in base.items()}
    generator = torch.Generator().manual_seed(seed + 1)
    for i in range(tasks):
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                tau = (
                    TASK_VECTOR_SCALE
                    * base[key].std().nan_to_num(0.02).clamp_min(0.02)
                    * torch.randn(value.shape, generator=generator)
                )
                value.copy_(base[key] + tau)
                merged[key] += 0.3 * tau
        model.save_pretrained(workdir / "experts" / f"t{i}")
    model.load_state_dict(merged)
    model.save_pretrained(workdir / "merged")


def _memory() -> dict[str, int]:
    """This process's memory from /proc/self/status, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _images(task_index: int, images: int, image_size: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + task_index)
    return torch.randn(images, 3, image_size, image_size, generator=generator)


def run_point(
    workdir: Path, tasks: int, images: int, batch_size: int, reference: bool, save: Path | None, device: str = "cpu"
) -> dict:
    """One calibration in this process; returns its time and memory, and saves the weights if asked."""
    import torch
    from transformers import CLIPVisionModel

    merged = CLIPVisionModel.from_pretrained(str(workdir / "merged")).eval()
    size = merged.config.image_size
    names = [f"t{i}" for i in range(tasks)]
    before = _memory()
    start, cpu = time.perf_counter(), time.process_time()
    if reference:
        sys.path.insert(0, str(REPO))
        from tests.support.reference_featcal import plain_featcal

        base = CLIPVisionModel.from_pretrained(str(workdir / "base")).eval()
        experts = [CLIPVisionModel.from_pretrained(str(workdir / "experts" / n)).eval() for n in names]
        out = plain_featcal(merged, base, experts, [_images(i, images, size) for i in range(tasks)])
    else:
        from featcal.calibration import FeatCalParams, featcal_calibrate
        from featcal.families.clip_vision.folders import vision_checkpoint

        try:  # as every featcal command does; an older tree (--baseline-root) has no such module
            from featcal.allocator import keep_freed_memory_for_reuse

            keep_freed_memory_for_reuse()
        except ImportError:
            pass
        params = FeatCalParams(num_calibration_examples=images, calibration_batch_size=batch_size)
        base = vision_checkpoint(workdir / "base")
        experts = {n: vision_checkpoint(workdir / "experts" / n) for n in names}
        out = featcal_calibrate(
            merged,
            base,
            experts,
            lambda name: _images(names.index(name), images, size),
            params,
            device=device,
            progress=False,
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    memory = _memory()
    if device.startswith("cuda"):
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    if save is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in out.state_dict().items()}, str(save))
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "memory_before": before,
        "memory": memory,
        "torch_threads": torch.get_num_threads(),
    }


def update_errors(ours: dict, reference: dict, start: dict) -> dict[str, float]:
    """‖ours − reference‖ / ‖reference − start‖ (the tests' measure) for every encoder-layer tensor
    the reference calibration changed from ``start``."""
    import torch

    return {
        key: float((ours[key] - reference[key]).norm() / (reference[key] - start[key]).norm())
        for key in reference
        if key.startswith("encoder.layers.") and not torch.equal(reference[key], start[key])
    }


def max_update_error(ours: Path, reference: Path, merged: Path) -> dict:
    """max over calibrated tensors of ``update_errors``."""
    from safetensors.torch import load_file

    start = load_file(str(merged / "model.safetensors"))
    start = {k.removeprefix("vision_model."): v for k, v in start.items()}
    errors = update_errors(load_file(str(ours)), load_file(str(reference)), start)
    worst = max(errors, key=errors.get)
    return {"max": errors[worst], "tensor": worst, "tensors": len(errors)}


# -- the grid --------------------------------------------------------------------------------
def _probe_gflops() -> float:
    """A one-second float32 matmul probe (wall clock): what this process gets from the CPU right now."""
    import torch

    a = torch.randn(2048, 2048)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def _spawn(
    args: argparse.Namespace, tasks: int, images: int, reference: bool, save: Path | None, engine_root: Path | None
) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if engine_root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(engine_root), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"{tasks}x{images}",
        "--workdir",
        str(args.workdir),
        "--batch-size",
        str(args.batch_size),
        "--threads",
        str(args.threads),
    ]
    cmd += ["--reference"] if reference else ["--device", args.device]
    cmd += ["--save", str(save)] if save else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"point {tasks}x{images} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(point: dict) -> str:
    gib = 2**30
    agree = point.get("agreement")
    return (
        f"| {point['implementation']} | {point['tasks']} | {point['images']} | {point['batch_size']} | "
        f"{point['seconds']:.1f} | {point['cpu_seconds']:.0f} | {point['seconds_per_task_image']:.3f} | "
        f"{point['gflops']:.0f} | {point['probe_gflops']:.0f} | {point['memory']['VmHWM'] / gib:.2f} | "
        f"{point['memory']['RssFile'] / gib:.2f} | {'' if agree is None else f'{agree:.1e}'} |"
    )


def table(points: list[dict]) -> str:
    head = (
        "| implementation | tasks | images | batch | time (s) | CPU (s) | s / task-image | effective GFLOP/s "
        "| probe GFLOP/s | peak RSS (GiB) | file-backed RSS at end (GiB) | max update error vs plain |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    return "\n".join([head, *map(_row, points)])


def fit(points: list[dict], implementation: str, key: str = "seconds") -> dict | None:
    """Least squares ``key`` ≈ a + b·tasks + c·tasks·images over one implementation's points (≥ 3 distinct)."""
    import numpy as np

    rows = [p for p in points if p["implementation"] == implementation]
    if len({(p["tasks"], p["images"]) for p in rows}) < 3:
        return None
    x = np.array([[1.0, p["tasks"], p["tasks"] * p["images"]] for p in rows])
    y = np.array([p[key] for p in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    return {
        "constant_s": coef[0],
        "per_task_s": coef[1],
        "per_task_image_s": coef[2],
        "max_relative_residual": float(np.max(np.abs(residual) / y)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--points",
        nargs="+",
        default=DEFAULT_POINTS,
        metavar="TxN",
        help=f"tasks x images per task (default {' '.join(DEFAULT_POINTS)})",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="calibration_batch_size (default 16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where featcal computes, e.g. cuda (default cpu)")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also run the plain implementation (tests/support/reference_featcal.py) at each point "
        "and report the largest difference of the weights",
    )
    parser.add_argument("--engine-root", type=Path, help="a folder holding another `featcal` package to measure")
    parser.add_argument("--label", default="featcal", help="implementation name in the results")
    parser.add_argument(
        "--baseline-root",
        type=Path,
        help="a folder holding another `featcal` package, run at each point just before this one "
        "(same machine load for both)",
    )
    parser.add_argument("--baseline-label", default="baseline", help="its name in the results")
    parser.add_argument("--workdir", type=Path, help="where the models live (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_speed.json")
    parser.add_argument("--child", metavar="TxN", help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        tasks, images = map(int, args.child.split("x"))
        print(
            json.dumps(run_point(args.workdir, tasks, images, args.batch_size, args.reference, args.save, args.device))
        )
        return

    grid = [tuple(map(int, p.split("x"))) for p in args.points]
    with tempfile.TemporaryDirectory(prefix="featcal-speed-") as tmp:
        args.workdir = args.workdir or Path(tmp)
        start = time.perf_counter()
        build_models(args.workdir, max(t for t, _ in grid))
        print(f"models ready in {time.perf_counter() - start:.0f} s ({args.workdir})", flush=True)
        shape, points = ViTShape(), []
        for tasks, images in grid:
            runs = [("plain (tests/support/reference_featcal.py)", True, None)] if args.reference else []
            runs += [(args.baseline_label, False, args.baseline_root)] if args.baseline_root else []
            saved: dict[bool, Path] = {}
            for implementation, reference, root in [*runs, (args.label, False, args.engine_root)]:
                probe, load = _probe_gflops(), os.getloadavg()[0]
                saved[reference] = Path(tmp) / f"out-{reference}.safetensors" if args.reference else None
                result = _spawn(args, tasks, images, reference, saved[reference], root)
                flops = count_work(shape, tasks, images)["total_flops"]  # the specified work, whoever runs it
                point = {
                    "implementation": implementation,
                    "tasks": tasks,
                    "images": images,
                    "batch_size": args.batch_size,
                    "device": "cpu" if reference else args.device,
                    **result,
                    "seconds_per_task_image": result["seconds"] / (tasks * images),
                    "gflops": flops / result["seconds"] / 1e9,
                    "probe_gflops": probe,
                    "load_average_before": load,
                }
                if args.reference and not reference:
                    agreement = max_update_error(saved[False], saved[True], args.workdir / "merged")
                    point["agreement"], point["agreement_tensor"] = agreement["max"], agreement["tensor"]
                points.append(point)
                print(_row(point), flush=True)
    labels = list(dict.fromkeys(p["implementation"] for p in points))
    fits = {f"{label} {key}": fit(points, label, key) for label in labels for key in ("seconds", "cpu_seconds")}
    report = {
        "environment": environment(args.threads),
        "shape": "ViT-B/32 (CLIPVisionConfig defaults)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "fits": fits,
        "points": points,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(points) + "\n")
    print(table(points))
    for name, f in fits.items():
        if f:
            print(
                f"{name} ≈ {f['constant_s']:.1f} s + {f['per_task_s']:.2f} s·tasks + {f['per_task_image_s']:.3f} "
                f"s·tasks·images (largest residual {100 * f['max_relative_residual']:.0f}%)"
            )


if __name__ == "__main__":
    main()
