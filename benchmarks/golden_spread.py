"""How far the golden run's outputs move under other CPU kernels, thread counts and float64, and under real changes.

    python benchmarks/golden_spread.py                      # every variant → results/golden_spread.json
    python benchmarks/golden_spread.py --variants default mkl-compatible --out /tmp/spread.json

The golden run is `tests/test_pipeline.py`'s: `featcal run` on the tiny-clip-3task fixture, with the
command recorded in `tests/golden/tiny_fixture_run.json`. Each variant runs in a process of its own,
since the kernel settings are environment variables read when torch loads its libraries:

- thread counts (`--threads 2`; the run picks one thread on the fixture by itself);
- MKL: `MKL_CBWR` (its conditional numerical reproducibility branch) and `MKL_ENABLE_INSTRUCTIONS`;
- ATen's vectorised kernels: `ATEN_CPU_CAPABILITY` (default = no SIMD, avx2, avx512);
- oneDNN: `ONEDNN_MAX_CPU_ISA`;
- float64: FeatCal's engine on a float64 copy of the merged model (forwards, products and sums in
  float64), and the plain float64 implementation of `tests/support/reference_featcal.py`;
- real changes of the run, to size a tolerance against: α 0.25 → 0.30, λ 0.05 → 0.06, seed 42 → 43.

Measured per variant, against the recorded golden files: for every calibrated tensor
‖variant − golden‖ / ‖golden − merged‖ (the test's measure; its largest value and tensor), whether the
merged weights hash to the golden SHA-256, each stage's losses relative to the golden ones, and whether
every accuracy equals the golden one. Every logit of the run's evaluations is recorded too: reported
are the largest logit difference from the `default` variant and the smallest gap between a test
image's two highest logits (what a change of accuracy would have to cross).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "golden_spread.json"
GOLDEN_DIR = ROOT / "tests" / "golden"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-clip-3task"

PINNED = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# name → (environment, extra `featcal run` arguments, kind)
VARIANTS: dict[str, tuple[dict[str, str], list[str], str]] = {
    "default": ({}, [], "run"),
    "default-again": ({}, [], "run"),
    "threads-2": ({}, ["--threads", "2"], "run"),
    "mkl-instructions-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, [], "run"),
    "mkl-instructions-sse4_2": ({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, [], "run"),
    "mkl-cbwr-avx2": ({"MKL_CBWR": "AVX2"}, [], "run"),
    "mkl-cbwr-compatible": ({"MKL_CBWR": "COMPATIBLE"}, [], "run"),
    "mkl-cbwr-compatible-threads-2": ({"MKL_CBWR": "COMPATIBLE"}, ["--threads", "2"], "run"),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, [], "run"),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, [], "run"),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, [], "run"),
    "onednn-sse41": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, [], "run"),
    "all-lowest": (
        {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
        [],
        "run",
    ),
    "pinned": (PINNED, [], "run"),
    "pinned-threads-2": (PINNED, ["--threads", "2"], "run"),
    "pinned-mkl-instructions-sse4_2": ({**PINNED, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, [], "run"),
    "float64-engine": ({}, [], "float64-engine"),
    "float64-plain": ({}, [], "float64-plain"),
    "calibration-batch-8": ({}, ["--calibration-batch-size", "8"], "run"),
    "change-alpha-0.30": ({}, ["--teacher-interp-alpha", "0.30"], "run"),
    "change-lambda-0.06": ({}, ["--lambda-ratio", "0.06"], "run"),
    "change-seed-43": ({}, ["--seed", "43"], "run"),
}


def golden_command() -> list[str]:
    """The recorded `featcal run` arguments, with the fixture's paths made absolute."""
    command = json.loads((GOLDEN_DIR / "tiny_fixture_run.json").read_text())["command"].split()[1:]
    prefix = "tests/fixtures/tiny-clip-3task/"
    return [str(FIXTURE / a.removeprefix(prefix)) if a.startswith("tests/") else a for a in command]


def update_ratios(calibrated: dict, golden: dict, merged: dict) -> dict[str, float]:
    """‖calibrated − golden‖ / ‖golden − merged‖ per tensor the calibration moves (in float64)."""
    ratios = {}
    for name, expected in golden.items():
        update = (expected.double() - merged[name].double()).norm()
        if update > 0:
            ratios[name] = float((calibrated[name].double() - expected.double()).norm() / update)
    return ratios


def run_variant(extra: list[str]) -> dict:
    """The golden run with ``extra`` arguments, in this process: its weights, metrics and logits."""
    import torch
    from safetensors.torch import load_file

    from featcal.cli import main
    from featcal.families.clip_vision.evaluation import ZeroShotClassifier

    logits: list[list[list[float]]] = []
    original = ZeroShotClassifier.logits

    def recorded(self, vision_model, pixel_values, task):
        out = original(self, vision_model, pixel_values, task)
        logits.append(out.double().tolist())
        return out

    ZeroShotClassifier.logits = recorded
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        assert main([*golden_command(), *extra, "--output-dir", str(out)]) == 0
        merged_bytes = (out / "ta" / "model.safetensors").read_bytes()
        merged = load_file(out / "ta" / "model.safetensors")
        calibrated = load_file(out / "featcal-ta" / "model.safetensors")
        metrics = {
            s: json.loads((out / s / "metrics.json").read_text()) for s in ("zero-shot", "experts", "ta", "featcal-ta")
        }
    return {
        "merged_sha256": hashlib.sha256(merged_bytes).hexdigest(),
        "calibrated": calibrated,
        "merged": merged,
        "metrics": metrics,
        "logits": logits,
        "threads": torch.get_num_threads(),
    }


def fixture_inputs(dtype):
    """The golden run's merged model, base, experts and calibration images, built as the run builds them."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.families.clip_vision.images import calibration_pixels
    from featcal.merging import get_method
    from featcal.tasks import load_task_file

    table = load_task_file(FIXTURE / "tasks.json")
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    merged_state = get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3)
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    merged.load_state_dict(merged_state)
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    pixels = {t: calibration_pixels(table.tasks[t], processor, 8, 42).to(dtype) for t in table.tasks}
    return base, experts, merged.eval(), pixels


def float64_engine() -> dict:
    """FeatCal's engine on a float64 copy of the merged model (float64 forwards, products, sums, solves)."""
    import torch

    from featcal.calibration import FeatCalParams, featcal_calibrate

    base, experts, merged, pixels = fixture_inputs(torch.float64)
    params = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    model = featcal_calibrate(merged.double(), base, experts, pixels.__getitem__, params, progress=False)
    return {k: v.detach() for k, v in model.state_dict().items()}


def float64_plain() -> dict:
    """`tests/support/reference_featcal.plain_featcal` on the same inputs, kept in float64."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT))
    from tests.support.reference_featcal import plain_featcal

    base, experts, merged, pixels = fixture_inputs(torch.float32)
    base_model = copy.deepcopy(merged)
    base_model.load_state_dict(dict(base))
    expert_models = []
    for ckpt in experts.values():
        m = copy.deepcopy(merged)
        m.load_state_dict(dict(ckpt))
        expert_models.append(m)
    keep = torch.nn.Module.float
    torch.nn.Module.float = lambda self: self  # plain_featcal casts its float64 result back; keep it float64
    try:
        model = plain_featcal(merged, base_model, expert_models, [pixels[t] for t in experts])
    finally:
        torch.nn.Module.float = keep
    return {k: v.detach() for k, v in model.state_dict().items()}


def child(name: str, save: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    _, extra, kind = VARIANTS[name]
    golden = load_file(GOLDEN_DIR / "tiny_fixture_featcal-ta.safetensors")
    recorded = json.loads((GOLDEN_DIR / "tiny_fixture_run.json").read_text())
    report: dict = {"environment": {k: os.environ.get(k) for k in sorted({*PINNED, "MKL_ENABLE_INSTRUCTIONS"})}}
    report["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if kind == "run":
        run = run_variant(extra)
        state, merged = run["calibrated"], run["merged"]
        report["threads"] = run["threads"]
        report["merged_sha256_is_golden"] = run["merged_sha256"] == recorded["weights_sha256"]["ta"]
        losses, accuracies_equal = {}, True
        for stage, expected in recorded["metrics"].items():
            for key, value in expected.items():
                if key == "model_info":
                    continue
                got = run["metrics"][stage][key]
                losses[f"{stage}/{key}"] = abs(got["loss"] - value["loss"]) / abs(value["loss"])
                accuracies_equal &= got["accuracy"] == value["accuracy"]
        report["worst_loss_relative"] = max(losses.values())
        report["accuracies_equal_golden"] = accuracies_equal
        report["logits"] = run["logits"]
    else:
        base, experts, merged_model, _ = fixture_inputs(torch.float32)
        merged = {k: v.detach() for k, v in merged_model.state_dict().items()}
        state = float64_engine() if kind == "float64-engine" else float64_plain()
        # the same state rounded to float32, as a float32 file would hold it
        rounded = update_ratios({k: v.float() for k, v in state.items()}, golden, merged)
        report["worst_after_rounding_to_float32"] = max(rounded.values())
    save_file({k: v.contiguous() for k, v in state.items()}, save)
    save_file({k: v.contiguous() for k, v in merged.items()}, save.with_suffix(".merged"))
    ratios = update_ratios(state, golden, merged)
    worst = max(ratios, key=ratios.get)
    report.update(worst=ratios[worst], worst_tensor=worst, median=sorted(ratios.values())[len(ratios) // 2])
    report["tensors"] = len(ratios)
    report["ratios"] = ratios
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.save)))
        return

    sys.path.insert(0, str(Path(__file__).parent))
    from allocator_speed import write_report

    results = {}
    states = Path(tempfile.mkdtemp(prefix="golden-spread-"))
    for name in args.variants:
        env_extra, extra, kind = VARIANTS[name]
        env = {k: v for k, v in os.environ.items() if k not in {*PINNED, "MKL_ENABLE_INSTRUCTIONS"}}
        env.update(env_extra, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            [sys.executable, __file__, "--child", name, "--save", str(states / f"{name}.safetensors")],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        results[name].update(set_env=env_extra, arguments=extra, kind=kind)
        print(f"{name:34s} worst {results[name]['worst']:.3g} ({results[name]['worst_tensor']})", flush=True)

    import numpy as np

    reference = results.get("default", {}).get("logits")
    for report in results.values():
        logits = report.pop("logits", None)
        if logits is None:
            continue
        rows = np.concatenate([np.asarray(batch) for batch in logits])
        top = np.sort(rows, axis=1)
        report["smallest_top2_gap"] = float((top[:, -1] - top[:, -2]).min())
        if reference is not None:
            base_rows = np.concatenate([np.asarray(batch) for batch in reference])
            report["largest_logit_difference_from_default"] = float(np.abs(rows - base_rows).max())
    # every variant against the float64 engine's calibration (the float32 runs' own rounding error), and
    # the largest difference between two float32 runs of the golden settings, on the same measure
    from safetensors.torch import load_file

    merged = load_file(states / f"{args.variants[0]}.merged")
    loaded = {name: load_file(states / f"{name}.safetensors") for name in args.variants}
    float32_runs = [n for n in args.variants if VARIANTS[n][2] == "run" and not n.startswith(("change-",))]
    if "float64-engine" in loaded:
        for name, state in loaded.items():
            ratios = update_ratios(state, loaded["float64-engine"], merged)
            results[name]["worst_against_float64_engine"] = max(ratios.values())
    pairs = [
        (max(update_ratios(loaded[a], loaded[b], merged).values()), a, b)
        for i, a in enumerate(float32_runs)
        for b in float32_runs[i + 1 :]
    ]
    largest = max(pairs) if pairs else None
    shutil.rmtree(states)
    write_report(
        args.out,
        __doc__,
        largest_difference_between_float32_runs=None if largest is None else dict(zip(("worst", "a", "b"), largest)),
        variants=results,
        load_average_after=os.getloadavg(),
    )


if __name__ == "__main__":
    main()
