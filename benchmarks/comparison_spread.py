"""The merges' goldens and the tests' same-machine comparisons under other CPU kernels and thread counts.

    python benchmarks/comparison_spread.py                 # every variant → results/comparison_spread.json
    python benchmarks/comparison_spread.py --variants default pinned --out /tmp/c.json

Each variant (the kernel settings of `golden_spread.py`, set in a process of its own) measures:

- **merges** on the tiny-clip-3task fixture: Task Arithmetic, simple averaging and TIES against
  FusionBench 0.2.33's outputs in `tests/fixtures/tiny-clip-3task/expected` (largest difference in
  units of float32 spacing, and whether every bit is equal); WUDI (400 Adam steps, one thread) against
  FusionBench's on the test's measure ‖ours − FusionBench‖ / ‖FusionBench − base‖; each method's
  SHA-256 over its tensors, so variants can be compared bit for bit, and TSV, Iso-C and WUDI against
  the `default` variant on the update measure;
- **the sweep** (`tests/test_sweep.py`): each swept setting against its separate run, as the tests
  compare them (‖sweep − separate‖ / ‖separate − merged‖, largest over tensors);
- **the published code** (`tests/test_calibration_driver.py`): featcal against the published FeatCal
  output and against the plain float64 implementation, on the update measure;
- **the command line** (`tests/test_cli_pipeline_commands.py`): `featcal calibrate` and `featcal run
  --skip-ta` against the calibration of `featcal run` on the tests' built world: largest absolute
  difference, whether every bit is equal, and the same difference relative to the update.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "comparison_spread.json"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-clip-3task"
PINNED = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KNOBS = {*PINNED, "MKL_ENABLE_INSTRUCTIONS"}

VARIANTS: dict[str, tuple[dict[str, str], int]] = {  # name → (environment, torch threads)
    "default": ({}, 1),
    "threads-2": ({}, 2),
    "mkl-cbwr-compatible": ({"MKL_CBWR": "COMPATIBLE"}, 1),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, 1),
    "onednn-sse41": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, 1),
    "all-lowest": ({"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}, 1),
    "pinned": (PINNED, 1),
}

FUSIONBENCH = {
    "simple_average": ("fusionbench_simple_average", {}),
    "task_arithmetic": ("fusionbench_task_arithmetic", {"scaling_factor": 0.3}),
    "ties": ("fusionbench_ties", {"scaling_factor": 0.3, "top_k": 20, "merge_func": "sum"}),
}


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def spacing_units(ours, want) -> float:
    """The largest |ours − want| in units of float32 spacing at |want| (ulps)."""
    import torch

    spacing = torch.from_numpy(np.spacing(want.abs().numpy().astype(np.float32)))
    return float(((ours - want).abs() / spacing).max())


def update_worst(state: dict, expected: dict, start: dict, prefix: str = "") -> float:
    worst = 0.0
    for key, value in expected.items():
        if not key.startswith(prefix) or not value.is_floating_point():
            continue
        change = (value.double() - start[key].double()).norm()
        if change > 0:
            worst = max(worst, float((state[key].double() - value.double()).norm() / change))
    return worst


def merges(save: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.merging import get_method

    base = vision_checkpoint(FIXTURE / "base")
    experts = [vision_checkpoint(FIXTURE / "experts" / f"t{i}") for i in range(3)]
    report = {}
    for method, (expected, params) in FUSIONBENCH.items():
        merged = get_method(method)(base, experts, **params)
        reference = load_file(FIXTURE / "expected" / f"{expected}.safetensors")
        report[method] = {
            "sha256": digest(merged),
            "bit_equal_to_fusionbench": all(torch.equal(merged[k], v) for k, v in reference.items()),
            "largest_ulps_from_fusionbench": max(spacing_units(merged[k], v) for k, v in reference.items()),
        }
    for method in ("tsv", "iso_c", "wudi"):
        merged = get_method(method)(base, experts)
        save_file({k: v.contiguous() for k, v in merged.items()}, save.with_name(f"{save.stem}-{method}.safetensors"))
        report[method] = {"sha256": digest(merged)}
        if method == "wudi":
            reference = load_file(FIXTURE / "expected" / "fusionbench_wudi.safetensors")
            report[method]["worst_update_against_fusionbench"] = update_worst(merged, reference, base)
    return report


def sweep() -> dict:
    import dataclasses

    from transformers import CLIPImageProcessor, CLIPVisionModel

    from featcal.calibration import FeatCalParams, featcal_calibrate
    from featcal.calibration.sweep import featcal_calibrate_many
    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.families.clip_vision.images import calibration_pixels
    from featcal.merging import get_method
    from featcal.tasks import load_task_file

    table = load_task_file(FIXTURE / "tasks.json")
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    merged.load_state_dict(get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3))
    merged.eval()
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    merged_state = {k: v.detach() for k, v in merged.state_dict().items()}

    def state(model):
        return {k: v.detach() for k, v in model.state_dict().items()}

    def separate(params):
        n = params.num_calibration_examples
        pixels = {t: calibration_pixels(table.tasks[t], processor, n, 42) for t in table.tasks}
        return state(featcal_calibrate(merged, base, experts, pixels.__getitem__, params, progress=False))

    pixels = {t: calibration_pixels(table.tasks[t], processor, 12, 42) for t in table.tasks}
    common = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    cases = {
        "nested sizes 3, 4, 8, 12": [
            FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (3, 4, 8, 12)
        ],
        "lambda_ratio 0.01, 0.05, 0.2": [dataclasses.replace(common, lambda_ratio=v) for v in (0.01, 0.05, 0.2)],
        "anchor_blend_rho 1.0, 2.2": [dataclasses.replace(common, anchor_blend_rho=v) for v in (1.0, 2.2)],
        "teacher_interp_alpha 0.0, 0.5": [dataclasses.replace(common, teacher_interp_alpha=v) for v in (0.0, 0.5)],
    }
    report = {}
    for name, settings in cases.items():
        runs = dict(featcal_calibrate_many(merged, base, experts, pixels.__getitem__, settings, progress=False))
        report[name] = [
            update_worst(state(runs[i]), separate(params), merged_state, "encoder.layers.")
            for i, params in enumerate(settings)
        ]
    return report


def published() -> dict:
    """`tests/test_calibration_driver.py`'s comparisons: featcal (n = 12, batch 4) against the published
    code's output, and featcal (batch 5) against the plain float64 implementation, on the update measure."""
    import copy

    from safetensors.torch import load_file
    from transformers import CLIPImageProcessor, CLIPVisionModel

    sys.path.insert(0, str(ROOT))
    from featcal.calibration import FeatCalParams, featcal_calibrate
    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.families.clip_vision.images import calibration_pixels
    from featcal.merging import get_method
    from featcal.tasks import load_task_file
    from tests.support.reference_featcal import plain_featcal

    table = load_task_file(FIXTURE / "tasks.json")
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    merged.load_state_dict(get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3))
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    pixels = {t: calibration_pixels(table.tasks[t], processor, 12, 42) for t in table.tasks}
    start = {k: v.detach() for k, v in merged.state_dict().items()}

    def calibrated(batch):
        params = FeatCalParams(num_calibration_examples=12, calibration_batch_size=batch)
        model = featcal_calibrate(merged, base, experts, pixels.__getitem__, params, progress=False)
        return {k: v.detach() for k, v in model.state_dict().items()}

    expected = load_file(FIXTURE / "expected" / "featcal_reference_featcal.safetensors")
    base_model = copy.deepcopy(merged)
    base_model.load_state_dict(dict(base))
    expert_models = []
    for ckpt in experts.values():
        m = copy.deepcopy(merged)
        m.load_state_dict(dict(ckpt))
        expert_models.append(m)
    plain = plain_featcal(merged, base_model, expert_models, [pixels[t] for t in experts]).state_dict()
    return {
        "against_published_code": update_worst(calibrated(4), expected, start, "encoder.layers."),
        "against_plain_float64": update_worst(calibrated(5), plain, start, "encoder.layers."),
    }


def command_line() -> dict:
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT))
    from featcal.cli import main
    from tests.support.builders import build_world

    fast = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--eval-num-workers", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        world = build_world(Path(tmp) / "world")
        tasks = ["--tasks-file", str(world["tasks_file"]), "--device", "cpu"]
        run = Path(tmp) / "run"
        assert main(["-q", "run", *tasks, "--output-dir", str(run), *fast, "--eval-batch-size", "4"]) == 0
        assert main(["-q", "calibrate", "--merged", str(run / "ta"), "--output", f"{tmp}/c", *tasks, *fast[:4]]) == 0
        resumed = ["--skip-ta", "--ta-model-path", str(run / "ta"), "--skip-eval-ta", "--no-export"]
        assert main(["-q", "run", *tasks, "--output-dir", f"{tmp}/r", *fast, "--eval-batch-size", "4", *resumed]) == 0
        ta = load_file(run / "ta" / "model.safetensors")
        ref = load_file(run / "featcal-ta" / "model.safetensors")
        report = {}
        for name, folder in (("calibrate", f"{tmp}/c"), ("run --skip-ta", f"{tmp}/r/featcal-ta")):
            cal = load_file(Path(folder) / "model.safetensors")
            report[name] = {
                "bit_equal": all(torch.equal(cal[k], ref[k]) for k in ref),
                "largest_absolute": max(float((cal[k] - ref[k]).abs().max()) for k in ref),
                "worst_update": update_worst(cal, ref, ta, "encoder.layers."),
            }
        report["largest_update_element"] = max(float((ref[k] - ta[k]).abs().max()) for k in ref)
    return report


def child(threads: int, save: Path) -> dict:
    import torch

    torch.set_num_threads(threads)
    return {
        "environment": {k: os.environ.get(k) for k in sorted(KNOBS)},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "merges": merges(save),
        "sweep": sweep(),
        "published": published(),
        "command_line": command_line(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(VARIANTS[args.child][1], args.save)))
        return

    sys.path.insert(0, str(Path(__file__).parent))
    import shutil

    from allocator_speed import write_report
    from safetensors.torch import load_file

    from featcal.families.clip_vision.folders import vision_checkpoint

    states = Path(tempfile.mkdtemp(prefix="comparison-spread-"))
    results = {}
    for name in args.variants:
        env = {k: v for k, v in os.environ.items() if k not in KNOBS}
        env.update(VARIANTS[name][0], PYTHONPATH=str(ROOT))
        command = [sys.executable, __file__, "--child", name, "--save", str(states / f"{name}.safetensors")]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, json.dumps(results[name]), flush=True)
    if "default" in results:
        base = vision_checkpoint(FIXTURE / "base")
        for name in args.variants:
            for method in ("tsv", "iso_c", "wudi"):
                ours = load_file(states / f"{name}-{method}.safetensors")
                default = load_file(states / f"default-{method}.safetensors")
                results[name]["merges"][method]["worst_update_against_default"] = update_worst(ours, default, base)
    shutil.rmtree(states)
    write_report(args.out, __doc__, variants=results, load_average_after=os.getloadavg())


if __name__ == "__main__":
    main()
