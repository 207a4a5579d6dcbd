"""Calibration forwards in bfloat16 autocast or TF32 (``--precision``) against float32: weights and accuracy.

    python benchmarks/forward_precision.py                       # mini8 (seed 0) → results/forward_precision.json
    python benchmarks/forward_precision.py --zoo-seed 1 --out …  # another zoo
    python benchmarks/forward_precision.py --vit-b32 2x16 --workdir /tmp/fp  # and the ViT-B/32 shape
    python benchmarks/forward_precision.py --device cuda --precisions float32 tf32 bf16 --vit-b32 8x256 …

The mini8 offline benchmark is run once per precision (default float32 and bf16), Task Arithmetic
κ 0.3 + FeatCal, each in a fresh run folder. Reported: each task's accuracy and the average, and the
calibrated weights' difference from the float32 run as the tests measure it, ‖ours − float32‖ /
‖float32 − merged‖ per calibrated tensor (largest and median), with the time of each calibration.
With ``--vit-b32 TxN``, the same weight difference on ``calibration_speed.py``'s random
ViT-B/32-shaped base and experts (T tasks × N random images, FeatCal's library call alone, under the
run's precision settings): twelve layers of 768, where the rounding of the forwards has more layers to
travel through. bf16 autocast runs on any device, TF32 only on CUDA (on the CPU ``tf32`` is float32);
on a CPU without bfloat16 instructions bf16 is slower than float32, so only the weights and accuracies
measured there carry over to a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from allocator_speed import write_report
from calibration_speed import _images, build_models, update_errors
from safetensors.torch import load_file

from featcal.demo import ZooConfig, build_zoo, demo_run_spec
from featcal.pipeline import run_pipeline
from featcal.precision import PRECISIONS
from featcal.runfolder.layout import calibrated_stage_name, merged_stage_name

RESULTS = Path(__file__).parent / "results" / "forward_precision.json"
METHOD = "task_arithmetic"


def _weights(run: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / stage / "model.safetensors"))


def vit_b32_differences(workdir: Path, tasks: int, images: int, precisions: list[str], device: str) -> dict:
    """Each precision against float32 on the random ViT-B/32 shape: weight differences and times."""
    import time

    from transformers import CLIPVisionModel

    from featcal.calibration import FeatCalParams, featcal_calibrate
    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.precision import fixed_precision, forward_dtype

    build_models(workdir, tasks)
    names = [f"t{i}" for i in range(tasks)]
    params = FeatCalParams(num_calibration_examples=images, calibration_batch_size=16)
    merged = CLIPVisionModel.from_pretrained(str(workdir / "merged")).eval()
    start_state = {k: v.clone() for k, v in merged.state_dict().items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    states, seconds = {}, {}
    for precision in precisions:
        with fixed_precision(precision):
            sync()
            start = time.perf_counter()
            model = featcal_calibrate(
                merged,
                vision_checkpoint(workdir / "base"),
                {n: vision_checkpoint(workdir / "experts" / n) for n in names},
                lambda task: _images(names.index(task), images, merged.config.image_size),
                params,
                device=device,
                progress=False,
                forward_dtype=forward_dtype(precision),
            )
            sync()
        seconds[precision] = time.perf_counter() - start
        states[precision] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        del model
    differences = {
        precision: summarise(update_errors(states[precision], states["float32"], start_state))
        for precision in precisions
        if precision != "float32"
    }
    return {"point": f"{tasks}x{images}", "seconds": seconds, "differences": differences}


def summarise(differences: dict[str, float]) -> dict:
    worst = max(differences, key=differences.get)
    return {
        "largest": differences[worst],
        "largest_tensor": worst,
        "median": statistics.median(differences.values()),
        "tensors": len(differences),
    }


def mini8(args: argparse.Namespace, precisions: list[str], rows: dict, differences: dict, gaps: dict) -> Path:
    """The mini8 runs, one per precision: fills ``rows``, ``differences`` and ``gaps``; returns the zoo."""
    preset = ZooConfig.tiny(args.zoo_seed) if args.tiny else ZooConfig.mini8(args.zoo_seed)
    zoo = build_zoo(preset)
    merged, calibrated = merged_stage_name(METHOD), calibrated_stage_name(METHOD)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in precisions:
            run = Path(tmp) / precision
            spec = demo_run_spec(zoo, run, device=args.device, progress=False).replace(
                precision=precision, threads=args.threads
            )
            results = {stage: report.to_json() for stage, report in run_pipeline(spec).items()}
            timings = json.loads((run / "timings.json").read_text())
            rows[precision] = {
                "merged": results[merged],
                "featcal": results[calibrated],
                "calibrate_s": timings["calibrate_s"],
            }
            print(
                f"{precision}: TA {100 * results[merged]['average']['accuracy']:.2f} → TA + FeatCal "
                f"{100 * results[calibrated]['average']['accuracy']:.2f} "
                f"(calibration {rows[precision]['calibrate_s']:.1f} s)",
                flush=True,
            )
        start = _weights(Path(tmp) / "float32", merged)
        reference = _weights(Path(tmp) / "float32", calibrated)
        for precision in precisions[1:]:
            ours = _weights(Path(tmp) / precision, calibrated)
            differences[precision] = summarise(update_errors(ours, reference, start))
            gaps[precision] = 100 * (
                rows[precision]["featcal"]["average"]["accuracy"] - rows["float32"]["featcal"]["average"]["accuracy"]
            )
            print(
                f"{precision} against float32: weights {differences[precision]['largest']:.2e} of the update at "
                f"most ({differences[precision]['largest_tensor']}), median {differences[precision]['median']:.2e} "
                f"over {differences[precision]['tensors']} tensors; average accuracy {gaps[precision]:+.2f} points"
            )
    return zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as the demo)")
    parser.add_argument("--device", default="cpu", help="where the calibrations run (default cpu)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["float32", "bf16"],
        choices=PRECISIONS,
        help="float32 is always the reference",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--vit-b32", metavar="TxN", help="also measure the ViT-B/32 shape at T tasks × N images")
    parser.add_argument("--workdir", type=Path, help="where the ViT-B/32-shaped models live (default: temporary)")
    parser.add_argument("--no-mini8", action="store_true", help="the ViT-B/32 shape alone (no zoo to build)")
    args = parser.parse_args()
    precisions = ["float32", *(p for p in args.precisions if p != "float32")]
    torch.set_num_threads(args.threads)
    rows: dict[str, dict] = {}
    differences: dict[str, dict] = {}
    gaps: dict[str, float] = {}
    zoo = None if args.no_mini8 else mini8(args, precisions, rows, differences, gaps)
    vit = None
    if args.vit_b32:
        tasks, images = (int(part) for part in args.vit_b32.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            vit = vit_b32_differences(args.workdir or Path(tmp), tasks, images, precisions, args.device)
        for precision, summary in vit["differences"].items():
            print(
                f"ViT-B/32 shape {vit['point']}, {precision}: weights {summary['largest']:.2e} of the update at "
                f"most ({summary['largest_tensor']}), median {summary['median']:.2e}; calibration float32 "
                f"{vit['seconds']['float32']:.1f} s, {precision} {vit['seconds'][precision]:.1f} s"
            )
    write_report(
        args.out,
        __doc__,
        zoo=None if zoo is None else {"folder": zoo.name, "seed": args.zoo_seed, "tiny": args.tiny},
        device=args.device,
        threads=args.threads,
        load_average=os.getloadavg(),
        runs=rows,
        weight_differences=differences,
        average_accuracy_difference_points=gaps,
        vit_b32=vit,
    )


if __name__ == "__main__":
    main()
