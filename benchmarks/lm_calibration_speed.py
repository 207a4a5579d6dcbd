"""FeatCal on a full-width Llama-3.2-3B stack: the work per layer, its floor on this machine, the measured time.

    python benchmarks/lm_calibration_speed.py --workdir /tmp/lm_speed --out benchmarks/results/lm_calibration_speed.json
    python benchmarks/lm_calibration_speed.py --device cuda --workdir /tmp/lm_speed --out /tmp/lm_speed_cuda.json

A random-weight ``LlamaForCausalLM`` with Llama-3.2-3B's widths (hidden 3072, intermediate 8192, 24 heads
and 8 key/value heads of 128) but 2 decoder layers and a 1024-token vocabulary (the embedding and the head
are not calibrated), a bfloat16 base, experts (base + noise) and their Task Arithmetic merge written as
folders (``lm_memory.build``), is calibrated through featcal's folder path (``featcal_calibrate_folder``,
the one ``featcal run`` uses for language models: streamed, written to a folder) in float32, in one
process, on random token ids: ``--tasks`` tasks × ``--examples`` sequences of ``--length`` tokens (default
2 × 16 = 32 sequences of 512 tokens, no padding), batches of 16.

The work is counted analytically (:func:`count_work`: matrix products only, 2 FLOPs per multiply-add):
per layer the statistics forwards (the merged layer to ``down_proj``'s input, the expert's whole layer),
the statistics products (``Σ x_sᵀ[x_s | x_e]`` over the upper block triangle, as the engine multiplies;
``down_proj`` crossed with the expert's outputs), the task folds (``C_sτ·W_tᵀ``, float32), the solves
(a Cholesky factorisation and two triangular solves per group, float64) and the merged layer's advance
(every layer but the last). The floor is that work at this machine's best matrix-product rate, measured
just before on products of the calibration's own shapes (float32) and on square ones (float64); each
phase is timed in place (``calibration_phases.PhaseTimer``) against its own floor. Peak memory: the
process's resident-set high-water mark over the calibration (``VmHWM``, reset just before), and on CUDA
``torch.cuda.max_memory_allocated``.

The script also extrapolates the counted work to the whole Llama-3.2-3B (28 layers) and Llama-3.1-8B
(32 layers) at MergeBench's calibration size (5 tasks × 256 sequences of 2048 tokens) on one GPU, at
assumed rates (``GPU_RATES``): an extrapolation, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from allocator_speed import write_report
from calibration_floor import environment
from calibration_phases import PhaseTimer
from lm_memory import LLAMA_3B, LLAMA_8B, Shape, auto_resident, build, predict

from featcal.allocator import keep_freed_memory_for_reuse
from featcal.calibration import driver as driver_module
from featcal.calibration.layer_state import LayerState
from featcal.calibration.solves import LinearSystem
from featcal.calibration.statistics import triangle_blocks

RESULTS = Path(__file__).parent / "results" / "lm_calibration_speed.json"
# Llama-3.2-3B's widths, 2 layers, a small vocabulary; the tasks, sequences and length are set from the flags.
STACK = replace(LLAMA_3B, layers=2, vocab=1024, tied=True, tasks=2, examples=16, length=512, batch=16)
# Assumed rates of one H100 SXM (TFLOP/s reachable by large products, below the data sheet's 67 float32 /
# 495 tf32 dense / 67 float64 tensor-core peaks): an assumption for the extrapolation, not a measurement.
GPU_RATES = {"float32": 50.0, "tf32": 300.0, "float64": 50.0}


# --- the work --------------------------------------------------------------------------------------


def groups(s: Shape) -> dict[str, tuple[int, int, int]]:
    """The solved linear groups of a decoder layer: (d_in, columns crossed with it, d_out). q/k/v and
    gate/up read one input each and are crossed with the expert's inputs; ``down_proj`` (narrower output
    than input) with the expert's outputs (``ProjectedLinearMoments``)."""
    d, i, h, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv": (d, d, h + 2 * kv), "o_proj": (h, h, d), "gate_up": (d, d, 2 * i), "down_proj": (i, d, d)}


def count_work(s: Shape) -> dict:
    """FLOPs of one calibration of shape ``s`` (all its layers), by phase, and per layer.

    Per token: a layer's linears (2·d_in·d_out each) and its attention's two products (QKᵀ and AV, 2·L·h
    each: the full L×L square, which the kernels compute under an explicit causal mask). Element-wise work
    (norms, rotary embeddings, softmax, SiLU, the buffers' copies and the moments' float64 sums) is left out.
    """
    d, i, h, L = s.hidden, s.intermediate, s.heads * s.head_dim, s.length
    g = groups(s)
    linears = sum(2 * d_in * d_out for d_in, _, d_out in g.values())
    forward = linears + 2 * 2 * L * h  # one token through one layer
    student_statistics = forward - 2 * i * d  # stops at down_proj's input
    products = sum(
        2 * (stop - start) * (d_in + cross - start)
        for d_in, cross, _ in g.values()
        for start, stop in triangle_blocks(d_in)
    )
    fold = sum(2 * d_in * d_in * d_out for d_in, _, d_out in g.values())  # C_sτ·W_tᵀ (down_proj: C_ss·W_tᵀ)
    solve = sum(d_in**3 // 3 + 2 * d_in * d_in * d_out for d_in, _, d_out in g.values())
    tokens = s.tasks * s.examples * L
    per_layer = {  # float32 but for the solves
        "statistics forwards": tokens * (student_statistics + forward),
        "statistics products": tokens * products,
        "task folds": s.tasks * fold,
        "solves (float64)": solve,
        "advance": tokens * forward,
    }
    flops = {k: v * (s.layers - 1 if k == "advance" else s.layers) for k, v in per_layer.items()}
    return {
        "per_token_per_layer": {
            "forward": forward,
            "student_statistics_forward": student_statistics,
            "statistics_products": products,
        },
        "per_task_per_layer": {"fold": fold},
        "per_layer": per_layer,
        "flops": flops,
        "float32_flops": sum(v for k, v in flops.items() if "float64" not in k),
        "float64_flops": flops["solves (float64)"],
    }


def floor_seconds(flops: dict[str, int], f32: float, f64: float) -> dict[str, float]:
    """Seconds of each phase's products at ``f32`` / ``f64`` GFLOP/s."""
    return {k: v / ((f64 if "float64" in k else f32) * 1e9) for k, v in flops.items()}


# --- this machine's rates --------------------------------------------------------------------------


def matmul_gflops(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]], reps: int = 2) -> dict:
    """Best rate of ``torch.mm`` ([m, k] @ [k, n]) per shape, GFLOP/s (wall clock; CUDA synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - start)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e9
        del a, b
    return {"per_shape": rates, "best": max(rates.values())}


def rate_shapes(s: Shape) -> tuple[list, list]:
    """Products of the calibration's shapes: a forward chunk through gate/up and down_proj, a statistics
    block (384 columns of x_s against [x_s | x_e]) and a fold (C_sτ·W_tᵀ); float64: squares of the
    solves' sizes."""
    d, i = s.hidden, s.intermediate
    rows = 4096
    f32 = [(rows, d, 2 * i), (rows, i, d), (384, rows, 2 * d), (d, d, 2 * i), (4096, 4096, 4096)]
    f64 = [(d, d, d), (4096, 4096, 4096)]
    return f32, f64


# --- the calibration -------------------------------------------------------------------------------


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS")


def calibrate(s: Shape, folder: Path, out: Path, device: torch.device, stream_storage: str = "device") -> dict:
    """One calibration of ``folder``'s merge through ``featcal_calibrate_folder``, its phases timed
    (``stream_storage``: where the feature streams wait between their uses)."""
    from featcal.calibration.adapters import CalibrationBatch
    from featcal.calibration.params import FeatCalParams
    from featcal.calibration.streaming import featcal_calibrate_folder
    from featcal.families import get_family

    family = get_family("causal_lm")
    generator = torch.Generator().manual_seed(1)
    batches = {}
    for t in range(s.tasks):
        ids = torch.randint(1, s.vocab, (s.examples, s.length), generator=generator)
        mask = torch.ones_like(ids)
        batches[f"t{t}"] = CalibrationBatch({"input_ids": ids}, {"attention_mask": mask}, mask.float())
    experts = {f"t{t}": family.checkpoint(folder / f"expert{t}") for t in range(s.tasks)}
    params = FeatCalParams(num_calibration_examples=s.examples, calibration_batch_size=s.batch)
    timer = PhaseTimer(device)
    calibrator = driver_module.FeatCalibrator
    timer.wrap(calibrator, "_all_first_inputs", "first-layer inputs")
    timer.wrap(calibrator, "_collect", "statistics pass (all)")
    timer.wrap(LayerState, "multiply", "statistics products")
    timer.wrap(LinearSystem, "add_task", "task folds")
    timer.wrap(calibrator, "_solve_into", "solves (float64)")
    timer.wrap(calibrator, "_advance", "advance")
    timer.wrap(driver_module, "load_params", "reading expert layers", outside="first-layer inputs")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    try:
        timer.sync()
        start = time.perf_counter()
        featcal_calibrate_folder(
            family, folder / "merged", out, family.checkpoint(folder / "base"), experts, batches.__getitem__,
            params, config=family.model_config(folder / "base"), device=device, progress=False,
            stream_storage=stream_storage,
        )  # fmt: skip
        timer.sync()
        total = time.perf_counter() - start
    finally:
        timer.remove()
    seconds = dict(timer.seconds)
    inner = seconds.get("statistics products", 0.0) + seconds.get("task folds", 0.0)
    seconds["statistics forwards"] = seconds.pop("statistics pass (all)") - inner
    seconds["rest"] = total - sum(seconds.values())
    seconds["total"] = total
    memory = {"rss_before": rss_before, "peak_rss": _hwm()}
    if device.type == "cuda":
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return {"seconds": seconds, "memory_bytes": memory}


# --- the extrapolation -----------------------------------------------------------------------------


def extrapolate(ratio: float | None) -> dict:
    """The counted work of the whole Llama-3.2-3B and Llama-3.1-8B at MergeBench's size, at ``GPU_RATES``:
    all float32, and forwards, products and folds at tf32 (solves float64 either way); with ``ratio`` (this
    run's measured / floor), the float32 floor times it as well. Memory: ``lm_memory.predict``'s peak, every
    stream on the device and as ``--stream-storage auto`` places them on an 80 GiB card."""
    out = {}
    for name, shape in (("Llama-3.2-3B", LLAMA_3B), ("Llama-3.1-8B", LLAMA_8B)):
        work = count_work(shape)
        f32 = floor_seconds(work["flops"], GPU_RATES["float32"] * 1e3, GPU_RATES["float64"] * 1e3)
        tf32 = floor_seconds(work["flops"], GPU_RATES["tf32"] * 1e3, GPU_RATES["float64"] * 1e3)
        entry = {
            "shape": asdict(shape),
            "tflop": {k: round(v / 1e12, 1) for k, v in work["flops"].items()},
            "tflop_total": round((work["float32_flops"] + work["float64_flops"]) / 1e12, 1),
            "floor_s_float32": round(sum(f32.values()), 1),
            "floor_s_tf32": round(sum(tf32.values()), 1),
            "per_layer_floor_s_float32": round(sum(f32.values()) / shape.layers, 2),
            "predicted_peak_gib": round(predict(shape)["peak"] / 2**30, 1),
            "predicted_peak_gib_auto_80": round(predict(auto_resident(shape))["peak"] / 2**30, 1),
        }
        if ratio is not None:
            entry["float32_floor_times_cpu_ratio_s"] = round(sum(f32.values()) * ratio, 1)
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=STACK.tasks)
    parser.add_argument("--examples", type=int, default=STACK.examples, help="sequences per task")
    parser.add_argument("--length", type=int, default=STACK.length, help="tokens per sequence")
    parser.add_argument("--tf32", action="store_true", help="CUDA: let float32 products use tf32")
    parser.add_argument(
        "--stream-storage", default="device", choices=("device", "host"),
        help="host: the feature streams in host memory, visiting the device (measures the copies' cost on CUDA)",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lm_calibration_speed"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    keep_freed_memory_for_reuse()  # featcal's own allocator settings
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.tf32:  # as featcal's --precision tf32 does
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    shape = replace(STACK, tasks=args.tasks, examples=args.examples, length=args.length)
    load_before = os.getloadavg()

    folder = args.workdir / f"stack-{shape.tasks}tasks"  # the models depend on the task count alone
    if not (folder / "merged").is_dir():
        start = time.perf_counter()
        build(shape, folder)
        print(f"built the models in {time.perf_counter() - start:.0f} s", flush=True)
    f32_shapes, f64_shapes = rate_shapes(shape)
    rates = {
        "float32": matmul_gflops(device, torch.float32, f32_shapes),
        "float64": matmul_gflops(device, torch.float64, f64_shapes),
    }
    f32, f64 = rates["float32"]["best"], rates["float64"]["best"]
    print(f"rates: float32 {f32:.0f} GFLOP/s, float64 {f64:.0f} GFLOP/s ({args.device})", flush=True)

    work = count_work(shape)
    floors = floor_seconds(work["flops"], f32, f64)
    floor = sum(floors.values())
    print(f"work {(work['float32_flops'] + work['float64_flops']) / 1e12:.2f} TFLOP, floor {floor:.1f} s", flush=True)
    run = calibrate(shape, folder, args.workdir / "calibrated", device, args.stream_storage)
    seconds, memory = run["seconds"], run["memory_bytes"]
    ratio = seconds["total"] / floor
    print("| phase | time (s) | floor (s) | time / floor |\n|---|---:|---:|---:|")
    for key, value in seconds.items():
        phase_floor = floor if key == "total" else floors.get(key)
        shown = "— | —" if phase_floor is None else f"{phase_floor:.1f} | {value / phase_floor:.2f}"
        print(f"| {key} | {value:.1f} | {shown} |")
    print(
        f"measured / floor {ratio:.2f}; peak RSS {memory['peak_rss'] / 2**30:.2f} GiB "
        f"(before the calibration {memory['rss_before'] / 2**30:.2f} GiB)"
    )
    extrapolation = extrapolate(ratio if device.type == "cpu" else None)
    for name, entry in extrapolation.items():
        print(
            f"{name}: {entry['tflop_total']} TFLOP, on one GPU at the assumed rates {entry['floor_s_float32']} s "
            f"(float32), {entry['floor_s_tf32']} s (tf32), peak {entry['predicted_peak_gib']} GiB "
            f"({entry['predicted_peak_gib_auto_80']} GiB with --stream-storage auto on 80 GiB; extrapolated)"
        )
    write_report(
        args.out, __doc__, device=args.device, threads=args.threads, tf32=args.tf32, shape=asdict(shape),
        stream_storage=args.stream_storage,
        sequences=shape.tasks * shape.examples, work=work, rates_gflops=rates,
        floor_s={k: round(v, 2) for k, v in floors.items()} | {"total": round(floor, 2)},
        measured_s={k: round(v, 2) for k, v in seconds.items()}, measured_over_floor=round(ratio, 3),
        memory_gib={k: round(v / 2**30, 3) for k, v in memory.items()},
        extrapolation={"assumed_gpu_tflops": GPU_RATES, "models": extrapolation},
        load_average_before=load_before, load_average_after=os.getloadavg(), environment=environment(args.threads),
        argv=sys.argv,
    )  # fmt: skip


if __name__ == "__main__":
    main()
