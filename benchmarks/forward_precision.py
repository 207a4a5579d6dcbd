"""Calibration forwards in bfloat16 autocast (``--precision bf16``) against float32: weights and accuracy.

    python benchmarks/forward_precision.py                       # mini8 (seed 0) → results/forward_precision.json
    python benchmarks/forward_precision.py --zoo-seed 1 --out …  # another zoo
    python benchmarks/forward_precision.py --vit-b32 2x16 --workdir /tmp/fp  # and the ViT-B/32 shape

The mini8 offline benchmark is run twice, Task Arithmetic κ 0.3 + FeatCal, with ``precision`` float32
and bf16 (one fresh run folder each; the merge and its evaluation are shared by construction, the
calibration and its evaluation are not). Reported: each task's accuracy and the average for both, and
the calibrated weights' difference as the tests measure it, ‖bf16 − float32‖ / ‖float32 − merged‖ per
calibrated tensor (largest and median), with the time of each calibration. With ``--vit-b32 TxN``,
the same weight difference on ``calibration_speed.py``'s random ViT-B/32-shaped base and experts
(T tasks × N random images, FeatCal's library call alone): twelve layers of 768, where the rounding of
the forwards has more layers to travel through. Autocast to bfloat16 runs on
any device; on a CPU without bfloat16 instructions it is slower than float32, so only the weights and
accuracies here carry over to a GPU.
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
from safetensors.torch import load_file

from featcal.demo import ZooConfig, build_zoo, demo_run_spec
from featcal.pipeline import run_pipeline
from featcal.runfolder import calibrated_stage_name, merged_stage_name

RESULTS = Path(__file__).parent / "results" / "forward_precision.json"
METHOD = "task_arithmetic"


def _weights(run: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / stage / "model.safetensors"))


def update_differences(ours: dict, reference: dict, start: dict) -> dict[str, float]:
    """‖ours − reference‖ / ‖reference − start‖ for every tensor the calibration changed."""
    return {
        key: float((ours[key] - reference[key]).norm() / (reference[key] - start[key]).norm())
        for key in reference
        if key.startswith("encoder.layers.") and not torch.equal(reference[key], start[key])
    }


def vit_b32_difference(workdir: Path, tasks: int, images: int) -> dict:
    """bf16 against float32 forwards on the random ViT-B/32 shape: weight difference and times."""
    import time

    from calibration_speed import _images, build_models
    from transformers import CLIPVisionModel

    from featcal.calibration import FeatCalParams, featcal_calibrate
    from featcal.checkpoint import Checkpoint

    build_models(workdir, tasks)
    names = [f"t{i}" for i in range(tasks)]
    params = FeatCalParams(num_calibration_examples=images, calibration_batch_size=16)
    merged = CLIPVisionModel.from_pretrained(str(workdir / "merged")).eval()
    start_state = {k: v.clone() for k, v in merged.state_dict().items()}
    states, seconds = {}, {}
    for name, dtype in (("float32", None), ("bf16", torch.bfloat16)):
        start = time.perf_counter()
        model = featcal_calibrate(
            merged,
            Checkpoint(workdir / "base"),
            {n: Checkpoint(workdir / "experts" / n) for n in names},
            lambda task: _images(names.index(task), images, merged.config.image_size),
            params,
            progress=False,
            forward_dtype=dtype,
        )
        seconds[name] = time.perf_counter() - start
        states[name] = {k: v.clone() for k, v in model.state_dict().items()}
    differences = update_differences(states["bf16"], states["float32"], start_state)
    return {"point": f"{tasks}x{images}", "seconds": seconds, **summarise(differences)}


def summarise(differences: dict[str, float]) -> dict:
    worst = max(differences, key=differences.get)
    return {
        "largest": differences[worst],
        "largest_tensor": worst,
        "median": statistics.median(differences.values()),
        "tensors": len(differences),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as the demo)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--vit-b32", metavar="TxN", help="also measure the ViT-B/32 shape at T tasks × N images")
    parser.add_argument("--workdir", type=Path, help="where the ViT-B/32-shaped models live (default: temporary)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = ZooConfig.tiny(args.zoo_seed) if args.tiny else ZooConfig.mini8(args.zoo_seed)
    zoo = build_zoo(preset)
    merged, calibrated = merged_stage_name(METHOD), calibrated_stage_name(METHOD)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("float32", "bf16"):
            run = Path(tmp) / precision
            spec = demo_run_spec(zoo, run, progress=False).replace(precision=precision, threads=args.threads)
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
        differences = update_differences(_weights(Path(tmp) / "bf16", calibrated), reference, start)
    summary = summarise(differences)
    worst = summary["largest_tensor"]
    gap = 100 * (rows["bf16"]["featcal"]["average"]["accuracy"] - rows["float32"]["featcal"]["average"]["accuracy"])
    print(
        f"bf16 against float32: weights {summary['largest']:.2e} of the update at most ({worst}), median "
        f"{summary['median']:.2e} over {summary['tensors']} tensors; average accuracy {gap:+.2f} points"
    )
    vit = None
    if args.vit_b32:
        tasks, images = (int(part) for part in args.vit_b32.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            vit = vit_b32_difference(args.workdir or Path(tmp), tasks, images)
        print(
            f"ViT-B/32 shape {vit['point']}: weights {vit['largest']:.2e} of the update at most "
            f"({vit['largest_tensor']}), median {vit['median']:.2e}; calibration float32 "
            f"{vit['seconds']['float32']:.1f} s, bf16 {vit['seconds']['bf16']:.1f} s"
        )
    write_report(
        args.out,
        __doc__,
        zoo={"folder": zoo.name, "seed": args.zoo_seed, "tiny": args.tiny},
        threads=args.threads,
        load_average=os.getloadavg(),
        runs=rows,
        weight_difference=summary,
        average_accuracy_difference_points=gap,
        vit_b32=vit,
    )


if __name__ == "__main__":
    main()
