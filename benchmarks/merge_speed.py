"""Speed and memory of each merging method on a ViT-B/32-shaped vision tower with 8 random experts.

Builds a random ``CLIPVisionModel(CLIPVisionConfig())`` (the defaults are ViT-B/32: hidden 768,
12 layers, MLP 3072, patch 32, image 224) as the base and experts = base + small random task
vectors, saved as safetensors folders in a temporary folder (nothing is downloaded). Each method
then runs in its own subprocess on lazily-read ``Checkpoint`` objects, so its memory is its own:

- ``seconds``: wall time of the merge call (tensors are read from the page cache: warm disk);
- ``cpu_seconds``: user + system CPU time of the merge call, all threads (steadier than wall time on
  a shared machine);
- ``peak_anon_mib``: the largest anonymous resident memory (``RssAnon``, sampled every 10 ms during
  the merge): what the method allocates, plus the interpreter and torch;
- ``vm_hwm_mib``: the kernel's peak RSS (``VmHWM``), which also counts the pages of the memory-mapped
  safetensors files that were read (reclaimable page cache).

    .venv/bin/python benchmarks/merge_speed.py                        # all methods, full size, ~10 min
    .venv/bin/python benchmarks/merge_speed.py --wudi-iterations 400  # WUDI's real 400 steps (slow)
    .venv/bin/python benchmarks/merge_speed.py --methods ties tsv --layers 2 --threads 1

WUDI's time is linear in its iterations: with ``--wudi-iterations N`` below 400 it also runs with 1
iteration (the per-tensor moments, the means, one step and torch's one-time optimizer imports) and
extrapolates ``t(400) = t(1) + 399/(N − 1) · (t(N) − t(1))``.

Writes ``benchmarks/results/merge_speed.json`` and the table in ``benchmarks/README-merging.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results" / "merge_speed.json"
README = HERE / "README-merging.md"
TASK_VECTOR_STD = 1e-3  # entries of each random task vector: N(0, TASK_VECTOR_STD²)
MIB = 1024 * 1024
WUDI_ITERATIONS = 400


def build_models(workdir: Path, experts: int, layers: int, seed: int = 0) -> dict[str, int]:
    """``base/`` (a CLIPVisionModel folder) and ``experts/t{i}/model.safetensors`` under ``workdir``."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(num_hidden_layers=layers)
    CLIPVisionModel(config).save_pretrained(workdir / "base")
    base = load_file(workdir / "base" / "model.safetensors")
    generator = torch.Generator().manual_seed(seed + 1)
    for i in range(experts):
        expert = {
            key: value + TASK_VECTOR_STD * torch.randn(value.shape, generator=generator)
            if value.is_floating_point()
            else value
            for key, value in base.items()
        }
        (workdir / "experts" / f"t{i}").mkdir(parents=True)
        save_file(expert, workdir / "experts" / f"t{i}" / "model.safetensors")
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": layers,
        "intermediate_size": config.intermediate_size,
        "patch_size": config.patch_size,
        "image_size": config.image_size,
        "parameters": sum(v.numel() for v in base.values()),
    }


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_one(method: str, workdir: Path, params: dict, threads: int | None) -> dict:
    """Merge in this process and return its time and memory (called in a fresh subprocess)."""
    import torch

    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.merging import get_method

    if threads:
        torch.set_num_threads(threads)

    fn = get_method(method)
    base = vision_checkpoint(workdir / "base")
    experts = [vision_checkpoint(p) for p in sorted((workdir / "experts").iterdir())]
    before = _status_mib("RssAnon")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], _status_mib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    merged = fn(base, experts, **params)
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _status_mib("RssAnon"))
    assert len(merged) == len(base)
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "threads": torch.get_num_threads(),
        "anon_before_mib": round(before),
        "peak_anon_mib": round(peak[0]),
        "vm_hwm_mib": round(_status_mib("VmHWM")),
        "params": fn.resolved_params(**params),
    }


def runs(methods: list[str], wudi_iterations: int) -> list[tuple[str, str, dict]]:
    """``(row label, method, params)`` for each subprocess."""
    plan = []
    for method in methods:
        if method != "wudi":
            plan.append((method, method, {}))
            continue
        if 1 < wudi_iterations < WUDI_ITERATIONS:
            plan.append(("wudi@1", "wudi", {"iterations": 1}))
        plan.append((f"wudi@{wudi_iterations}", "wudi", {"iterations": wudi_iterations}))
    return plan


def extrapolate_wudi(rows: dict, iterations: int) -> dict | None:
    """WUDI at its 400 iterations from runs at 1 and ``iterations`` (time is linear in iterations)."""
    if "wudi@1" not in rows:
        return None
    one, some = rows["wudi@1"], rows[f"wudi@{iterations}"]
    factor = (WUDI_ITERATIONS - 1) / (iterations - 1)
    return {
        **some,
        "seconds": round(one["seconds"] + factor * (some["seconds"] - one["seconds"]), 1),
        "cpu_seconds": round(one["cpu_seconds"] + factor * (some["cpu_seconds"] - one["cpu_seconds"]), 1),
        "params": {**some["params"], "iterations": WUDI_ITERATIONS},
        "extrapolated_from": [1, iterations],
    }


def markdown(results: dict) -> str:
    shape = results["shape"]
    lines = [
        "## Merging speed and memory",
        "",
        f"ViT-B/32-shaped vision tower ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"MLP {shape['intermediate_size']}, {shape['parameters'] / 1e6:.1f} M parameters), "
        f"{results['experts']} experts with random task vectors, float32, on "
        f"{results['machine']['cpus']} CPU cores ({results['machine']['processor']}), torch "
        f"{results['machine']['torch']}. Load average {results['machine']['loadavg_start']} at the start "
        f"and {results['machine']['loadavg_end']} at the end (the machine was shared).",
        "",
        f"    {results['command']}",
        "",
        "| run | hyper-parameters | torch threads | wall (s) | CPU (s) | peak anonymous RSS (MiB) | VmHWM (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["methods"].items():
        params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "–"
        if "extrapolated_from" in row:
            name, memory_cells = f"{name} (extrapolated)", "as above | as above"
        else:
            memory_cells = f"{row['peak_anon_mib']} | {row['vm_hwm_mib']}"
        lines.append(
            f"| {name} | {params} | {row['threads']} | {row['seconds']} | {row['cpu_seconds']} | {memory_cells} |"
        )
    lines += [
        "",
        f"Anonymous RSS before the merge call (interpreter, torch, open checkpoints): about "
        f"{min(r['anon_before_mib'] for r in results['methods'].values())} MiB. The merged state dict "
        f"itself is {results['shape']['parameters'] * 4 / MIB:.0f} MiB. VmHWM also counts the pages "
        "of the memory-mapped safetensors files that were read.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", help="default: every registered method")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--wudi-iterations", type=int, default=40, help="below 400: extrapolated to 400")
    parser.add_argument("--threads", type=int, help="torch threads in each run (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=RESULTS_JSON)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        print(json.dumps(run_one(args.run_one, args.workdir, args.params, args.threads)))
        return

    import torch

    from featcal.merging import available_methods

    methods = args.methods or available_methods()
    command = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    results: dict = {
        "command": command,
        "experts": args.experts,
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "methods": {},
    }
    with tempfile.TemporaryDirectory(prefix="featcal-merge-speed-") as tmp:
        workdir = Path(tmp)
        start = time.perf_counter()
        results["shape"] = build_models(workdir, args.experts, args.layers)
        print(f"built base + {args.experts} experts in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        for label, method, params in runs(methods, args.wudi_iterations):
            child = [
                sys.executable,
                __file__,
                "--run-one",
                method,
                "--workdir",
                str(workdir),
                "--params",
                json.dumps(params),
            ]
            if args.threads:
                child += ["--threads", str(args.threads)]
            out = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
            results["methods"][label] = json.loads(out.strip().splitlines()[-1])
            print(f"{label}: {results['methods'][label]}", file=sys.stderr)
    wudi = extrapolate_wudi(results["methods"], args.wudi_iterations)
    if wudi:
        results["methods"]["wudi"] = wudi
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.readme.write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
