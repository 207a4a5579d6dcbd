"""Where one FeatCal calibration's time goes, phase by phase, against each phase's floor.

    python benchmarks/calibration_phases.py --points 2x64 --workdir /tmp/cs --out results/calibration_phases_2x64.json

``calibration_speed.py``'s random ViT-B/32-shaped base and experts, FeatCal's library call on random
images, its engine's methods timed in place (a wrapper around each, no profiler): the forwards of the
statistics pass (student to fc2's input, expert whole), the statistics products (``LayerState.multiply``),
the task folds (``LinearSystem.add_task``), the solves (``_solve_into``: anchors, factorisations, writes),
the student's advance, and the rest. Each phase's floor is its matrix-product FLOPs
(``calibration_floor.count_work(engine=True)``) at this machine's square-product rate, measured just
before (float32; float64 for the solves): its efficiency is floor / time. ``--repeats`` runs the whole
calibration again in the same process and keeps each phase's fastest.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from allocator_speed import write_report
from calibration_floor import ViTShape, count_work, measure_matmul_gflops
from calibration_speed import _images, build_models

from featcal.allocator import keep_freed_memory_for_reuse
from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.calibration import driver as driver_module
from featcal.calibration.layer_state import LayerState
from featcal.calibration.solves import LinearSystem
from featcal.families.clip_vision.folders import vision_checkpoint

RESULTS = Path(__file__).parent / "results" / "calibration_phases.json"


class PhaseTimer:
    """Wall-clock seconds spent inside chosen methods, by label (CUDA work finished at each exit).

    A method wrapped with ``outside=L`` is not timed while a method labelled L is running (the expert
    stems' reads belong to the first-layer inputs, not to the layers' reading).
    """

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._undo: list[tuple[object, str, object]] = []
        self._running: set[str] = set()

    def wrap(self, owner: object, name: str, label: str, outside: str | None = None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if outside in self._running:
                return original(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            self._running.add(label)
            try:
                return original(*args, **kwargs)
            finally:
                self._running.discard(label)
                self.sync()
                self.seconds[label] += time.perf_counter() - start

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def time_phases(workdir: Path, tasks: int, images: int, device: torch.device) -> dict[str, float]:
    """One calibration with its phases timed."""
    from transformers import CLIPVisionModel

    merged = CLIPVisionModel.from_pretrained(str(workdir / "merged")).eval()
    names = [f"t{i}" for i in range(tasks)]
    pixels = {n: _images(i, images, merged.config.image_size) for i, n in enumerate(names)}
    timer = PhaseTimer(device)
    calibrator = driver_module.FeatCalibrator
    timer.wrap(calibrator, "_first_inputs", "first-layer inputs")
    timer.wrap(calibrator, "_collect", "statistics pass (all)")
    timer.wrap(LayerState, "multiply", "statistics products")
    timer.wrap(LinearSystem, "add_task", "task folds")
    timer.wrap(calibrator, "_solve_into", "solves")
    timer.wrap(calibrator, "_advance", "advance")
    timer.wrap(driver_module, "load_params", "reading expert layers", outside="first-layer inputs")
    params = FeatCalParams(num_calibration_examples=images, calibration_batch_size=16)
    try:
        timer.sync()
        start = time.perf_counter()
        featcal_calibrate(
            merged,
            vision_checkpoint(workdir / "base"),
            {n: vision_checkpoint(workdir / "experts" / n) for n in names},
            pixels.__getitem__,
            params,
            device=device,
            progress=False,
        )
        timer.sync()
        total = time.perf_counter() - start
    finally:
        timer.remove()
    seconds = dict(timer.seconds)
    inner = seconds["statistics products"] + seconds["task folds"]
    seconds["statistics forwards (and buffer copies)"] = seconds.pop("statistics pass (all)") - inner
    seconds["total"] = total
    seconds["rest"] = total - sum(v for k, v in seconds.items() if k != "total")
    return seconds


def phase_floors(tasks: int, images: int, f32: float, f64: float) -> dict[str, float]:
    """Seconds of each phase's matrix products at the measured rates (GFLOP/s)."""
    flops = count_work(ViTShape(), tasks, images, engine=True)["flops"]
    return {
        "first-layer inputs": flops["stems"] / f32 / 1e9,
        "statistics forwards (and buffer copies)": (flops["student_statistics_forward"] + flops["expert_forward"])
        / f32
        / 1e9,
        "statistics products": flops["statistics"] / f32 / 1e9,
        "task folds": flops["task_folds"] / f32 / 1e9,
        "solves": flops["solves"] / f64 / 1e9,
        "advance": flops["student_advance_forward"] / f32 / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["2x64"], metavar="TxN", help="tasks x images (default 2x64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="calibrations per point; each phase's fastest kept")
    parser.add_argument("--workdir", type=Path, required=True, help="where the models are built (kept)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    keep_freed_memory_for_reuse()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_before = os.getloadavg()
    rates = {name: measure_matmul_gflops(name, args.threads)["best"] for name in ("float32", "float64")}
    points = []
    for point in args.points:
        tasks, images = (int(part) for part in point.split("x"))
        build_models(args.workdir, tasks)
        runs = [time_phases(args.workdir, tasks, images, device) for _ in range(args.repeats)]
        best = {key: min(run[key] for run in runs) for key in runs[0]}
        floors = phase_floors(tasks, images, rates["float32"], rates["float64"])
        print(f"\n{point} (float32 {rates['float32']:.0f}, float64 {rates['float64']:.0f} GFLOP/s)")
        print("| phase | time (s) | floor (s) | floor / time |\n|---|---:|---:|---:|")
        for key, seconds in best.items():
            floor = floors.get(key)
            if key == "total":
                floor = sum(floors.values())
            shown = "" if floor is None else f"{floor:.1f} | {100 * floor / seconds:.0f} %"
            print(f"| {key} | {seconds:.2f} | {shown or '— | —'} |")
        points.append({"point": point, "runs": runs, "fastest": best, "floors": floors})
    write_report(
        args.out,
        __doc__,
        threads=args.threads,
        device=args.device,
        rates_gflops=rates,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        points=points,
    )


if __name__ == "__main__":
    main()
