"""The work FeatCal must do on a ViT-shaped model, and the time it takes at this machine's peak rates.

Counts FLOPs (matrix products only: 2 per multiply-add; element-wise work is a few percent and left
out) and bytes, measures this machine's float32/float64 matmul rate and file read rate, and writes
the floor for the reference setting (8 tasks × 256 images) to ``benchmarks/results/calibration_floor.json``.

    .venv/bin/python benchmarks/calibration_floor.py            # ViT-B/32, 2 threads

The counts are importable (``count_work``) so that ``calibration_speed.py`` reports achieved GFLOP/s
against the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class ViTShape:
    """A CLIP ViT vision tower; the defaults are ViT-B/32 (transformers ``CLIPVisionConfig()``)."""

    hidden: int = 768
    layers: int = 12
    mlp: int = 3072
    heads: int = 12
    image: int = 224
    patch: int = 32
    channels: int = 3

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2 + 1

    def linears(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every calibrated linear of one encoder layer."""
        d, m = self.hidden, self.mlp
        return {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "out_proj": (d, d), "fc1": (d, m), "fc2": (m, d)}

    def input_groups(self, last: bool) -> list[int]:
        """d_in of each distinct (input tensor, token weights) pair: q/k/v share one, except in the
        last layer where q is token-weighted and k/v are not."""
        d, m = self.hidden, self.mlp
        return [d, d, d, m] + ([d] if last else [])

    def params(self) -> int:
        """Parameters of the vision tower (stem, layers, final LayerNorm)."""
        d, m = self.hidden, self.mlp
        layer = 4 * (d * d + d) + (d * m + m) + (m * d + d) + 4 * d
        stem = self.channels * self.patch**2 * d + d + self.tokens * d + 2 * d
        return self.layers * layer + stem + 2 * d


def layer_forward_flops(s: ViTShape) -> int:
    """One encoder layer on one image: q, k, v, out, fc1, fc2 and the two attention products."""
    n, d = s.tokens, s.hidden
    linears = sum(2 * n * d_in * d_out for d_in, d_out in s.linears().values())
    attention = 2 * 2 * n * n * d  # QKᵀ and AV over all heads
    return linears + attention


def stem_flops(s: ViTShape) -> int:
    """Patch embedding (a matmul over the patches) of one image."""
    return 2 * (s.tokens - 1) * s.channels * s.patch**2 * s.hidden


def statistics_flops(s: ViTShape, *, symmetric: bool = True) -> int:
    """Σ x_sᵀx_s and Σ x_sᵀx_e over one image's tokens, for every distinct input of every layer.

    With ``symmetric`` the first costs one triangle (d(d+1)/2 entries), as it should.
    """
    n, total = s.tokens, 0
    for index in range(s.layers):
        for d_in in s.input_groups(last=index == s.layers - 1):
            gram = n * d_in * (d_in + 1) if symmetric else 2 * n * d_in * d_in
            total += gram + 2 * n * d_in * d_in
    return total


def engine_statistics_flops(s: ViTShape) -> int:
    """What featcal's engine multiplies per image: per distinct input one product x_sᵀ·[x_s | c] per
    row block of the upper block triangle (``triangle_blocks``), with c = x_e, or for fc2 (narrower
    output than input) c = y_e = W_t x_e, the expert's output: d_out instead of d_in columns."""
    from featcal.calibration.statistics import triangle_blocks

    n, total = s.tokens, 0
    for index in range(s.layers):
        for d_in in s.input_groups(last=index == s.layers - 1):
            cross = s.hidden if d_in == s.mlp else d_in  # fc2 is the only input group with d_out < d_in
            total += sum(2 * n * (stop - start) * (d_in + cross - start) for start, stop in triangle_blocks(d_in))
    return total


def task_fold_flops(s: ViTShape) -> int:
    """Per task and layer, folding C_sτ·W_tᵀ into the right-hand sides: 2·d_in²·d_out per linear."""
    return s.layers * sum(2 * d_in * d_in * d_out for d_in, d_out in s.linears().values())


def solve_flops(s: ViTShape) -> int:
    """Per layer: one Cholesky factorisation (d³/3) per distinct input, two triangular solves per linear
    (2·d_in²·d_out). q/k/v share one factorisation except in the last layer."""
    total = 0
    for index in range(s.layers):
        last = index == s.layers - 1
        total += sum(d_in**3 // 3 for d_in in s.input_groups(last))
        total += sum(2 * d_in * d_in * d_out for d_in, d_out in s.linears().values())
    return total


def count_work(s: ViTShape, tasks: int, images: int, *, engine: bool = False) -> dict[str, float]:
    """FLOPs and bytes of one calibration: ``tasks`` experts, ``images`` images per task.

    ``engine=False``: the work as specified (full student forward for the statistics, Σ x_sᵀx_e for
    every input). ``engine=True``: what featcal executes: the statistics pass stops at the last
    calibrated input (fc2's matmul is skipped) and fc2's cross statistics use the expert's outputs.
    """
    forward_layer = layer_forward_flops(s)
    last_linear = 2 * s.tokens * s.mlp * s.hidden
    per_image = {
        "student_statistics_forward": s.layers * (forward_layer - (last_linear if engine else 0)),
        "student_advance_forward": (s.layers - 1) * forward_layer,  # the last layer need not advance
        "expert_forward": s.layers * forward_layer,
        "stems": 2 * stem_flops(s),
        "statistics": engine_statistics_flops(s) if engine else statistics_flops(s),
    }
    ti = tasks * images
    flops = {key: value * ti for key, value in per_image.items()}
    flops["task_folds"] = task_fold_flops(s) * tasks
    flops["solves"] = solve_flops(s)
    weight_bytes = 4 * s.params()
    return {
        "per_image_flops": per_image,
        "flops": flops,
        "total_flops": sum(flops.values()),
        "statistics_flops_if_full_gram": statistics_flops(s, symmetric=False) * ti,
        "read_bytes": (tasks + 1) * weight_bytes,  # every expert once, the base once (float32)
        "weight_bytes": weight_bytes,
    }


def measure_matmul_gflops(
    dtype_name: str = "float32", threads: int = 2, sizes=(2048, 3072, 4096), reps: int = 3
) -> dict:
    """torch.mm on square matrices: the best wall-clock rate (lowered when other processes share the
    cores) and the best rate per CPU-second times ``threads`` (what the cores give when not shared)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    wall, cpu = {}, {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        best_wall = best_cpu = float("inf")
        for _ in range(reps):
            start, start_cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b)
            best_wall = min(best_wall, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
        wall[n] = 2 * n**3 / best_wall / 1e9
        cpu[n] = 2 * n**3 / best_cpu / 1e9 * threads
    return {
        "wall_per_size": wall,
        "cpu_per_size": cpu,
        "wall_best": max(wall.values()),
        "best": max(max(wall.values()), max(cpu.values())),
    }


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_read_rate(megabytes: int = 400, folder: str | None = None) -> dict:
    """Read rate of a ``megabytes`` safetensors file as the engine reads experts: every tensor copied
    out of a memory-mapped ``safe_open``. Cold: evicted from the page cache with posix_fadvise first
    (as far as the kernel allows; a virtual disk may still cache on the host); warm: from the page cache."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    per = 16 * 2**20 // 4
    target = torch.empty(per)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_file({f"t{i}": torch.randn(per) for i in range(megabytes // 16)}, str(path))
        size = path.stat().st_size
        rates = {}
        for label in ("cold", "warm"):
            if label == "cold":
                _drop_from_page_cache(path)
            start = time.perf_counter()
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    target.copy_(handle.get_tensor(key))
            rates[label] = size / (time.perf_counter() - start) / 1e9
    return {"bytes": size, "cold_GBps": rates["cold"], "warm_GBps": rates["warm"]}


def environment(threads: int) -> dict:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "torch": torch.__version__,
        "threads": threads,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def floor_seconds(work: dict, f32_gflops: float, f64_gflops: float, read_gbps: float) -> dict:
    """Time at peak rates: float32 products for the passes, statistics and folds, float64 for the
    solves; reading overlaps nothing (the sum, a bound the engine could reach)."""
    f64 = work["flops"]["solves"]
    f32 = work["total_flops"] - f64
    compute = f32 / (f32_gflops * 1e9) + f64 / (f64_gflops * 1e9)
    read = work["read_bytes"] / (read_gbps * 1e9)
    return {"compute_s": compute, "read_s": read, "floor_s": compute + read, "float32_flops": f32, "float64_flops": f64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--read-mb", type=int, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_floor.json")
    args = parser.parse_args()

    shape = ViTShape()
    works = {
        "specified": count_work(shape, args.tasks, args.images),
        "engine": count_work(shape, args.tasks, args.images, engine=True),
    }
    f32 = measure_matmul_gflops("float32", args.threads)
    f64 = measure_matmul_gflops("float64", args.threads)
    read = measure_read_rate(args.read_mb)
    floors = {k: floor_seconds(w, f32["best"], f64["best"], read["cold_GBps"]) for k, w in works.items()}
    result = {
        "shape": asdict(shape) | {"tokens": shape.tokens, "params": shape.params()},
        "tasks": args.tasks,
        "images": args.images,
        "work": works,
        "matmul_gflops": {"float32": f32, "float64": f64},
        "read": read,
        "floor": floors,
        "environment": environment(args.threads),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"ViT-B/32 shape: {shape.tokens} tokens/image, {shape.params() / 1e6:.1f} M parameters")
    print(
        f"rates: float32 {f32['best']:.1f} GFLOP/s (wall-clock {f32['wall_best']:.1f}), float64 {f64['best']:.1f} "
        f"GFLOP/s (wall-clock {f64['wall_best']:.1f}), "
        f"read cold {read['cold_GBps']:.2f} GB/s, warm {read['warm_GBps']:.2f} GB/s ({args.threads} threads)"
    )
    for name, work in works.items():
        per, floor = work["per_image_flops"], floors[name]
        print(
            f"[{name}] GFLOP per task-image: "
            + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in per.items())
            + f"; total {sum(per.values()) / 1e9:.2f}"
        )
        print(
            f"[{name}] {args.tasks} tasks × {args.images} images: {work['total_flops'] / 1e12:.1f} TFLOP "
            f"(task folds {work['flops']['task_folds'] / 1e12:.2f}, solves {work['flops']['solves'] / 1e12:.2f}), "
            f"{work['read_bytes'] / 1e9:.2f} GB to read; floor {floor['floor_s']:.0f} s "
            f"(compute {floor['compute_s']:.0f} s, read {floor['read_s']:.1f} s)"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
