"""Peak memory of FeatCal on a causal LM: the formula of docs/causal-lm.md ("Memory") against one calibration, measured.

    python benchmarks/lm_memory.py --workdir /tmp/lm_memory --out benchmarks/results/lm_memory.json

For each small Llama shape below, a random bfloat16 base, experts (base + noise) and their Task
Arithmetic merge are written as folders; a child process then calibrates the merged folder with
``featcal_calibrate_folder`` (streamed, written to a folder, on the CPU) on random token ids with
padding (each task's texts padded to the task's longest, ``L``). The child first calibrates a tiny
Llama, so that what a process holds whatever the model (modules imported on first use, BLAS and LAPACK
buffers, thread pools) is resident before the measurement. It then measures its resident set
(``/proc/self/status`` ``VmHWM``, reset through ``/proc/self/clear_refs`` at the start of each phase):
the peak of each phase (first-layer inputs, the statistics forwards, the task folds, the solves, the
student's advance) above the resident set just before the calibration. The child's glibc maps every
allocation above 64 KiB afresh and returns it when freed (``MALLOC_MMAP_THRESHOLD_``), so its resident
set follows the live tensors, as a GPU allocator's peak does; ``--featcal-allocator`` measures with the
settings ``featcal`` itself gives glibc (freed blocks up to 32 MiB kept for reuse) instead.

:func:`predict` is the formula: the bytes of each term, and the peak of each phase, from the shape
alone. The script prints, and writes, the formula's terms for Llama-3.2-3B and Llama-3.1-8B at the
MergeBench calibration size (5 tasks, n = 256 texts each, L = 2048 tokens, batches of 16) beside the
measured shapes, so the numbers in the docs come from the function the measurements check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "lm_memory.json"
GIB = 2**30
F32, F64 = 4, 8
STATISTICS_CHUNK_TOKENS = 4096  # featcal.calibration.driver's
ALIGNMENT = 64  # featcal.calibration.workspace's


@dataclass(frozen=True)
class Shape:
    """A Llama and its calibration: the model's sizes, the tasks, texts per task and process (n), the
    padded length (L, every task's here), the forward batch (b) and the processes sharing the texts."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    tasks: int
    examples: int
    length: int
    batch: int = 16
    processes: int = 1
    resident_tasks: int | None = None  # tasks whose streams stay on the device (None: all; 0: --stream-storage host)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def per_process(self) -> int:
        return -(-self.examples // self.processes)

    @property
    def resident(self) -> int:
        return self.tasks if self.resident_tasks is None else self.resident_tasks

    @property
    def stream_storage(self) -> str:
        return "device" if self.resident == self.tasks else "host" if self.resident == 0 else "auto"


# The measured shapes: one where the feature streams weigh most, one where a layer's statistics and solves
# do (wide, few tokens), one where a forward batch's activations do (long texts in large batches).
MEASURED = {
    "streams": Shape(256, 704, 2, 4, 2, 4096, False, tasks=4, examples=96, length=256, batch=8),
    "layer": Shape(1024, 2816, 2, 8, 2, 4096, False, tasks=2, examples=8, length=64, batch=8),
    "activations": Shape(512, 1408, 2, 8, 2, 4096, True, tasks=2, examples=16, length=512, batch=16),
    # the streams shape with --stream-storage host: on the CPU the host streams and their device copies are
    # both in RAM, so the resident set is the formula's device peak plus its host streams
    "streams-host": Shape(256, 704, 2, 4, 2, 4096, False, tasks=4, examples=96, length=256, batch=8, resident_tasks=0),
}
# Llama-3.2-3B and Llama-3.1-8B at the MergeBench calibration size: 5 tasks, n = 256 (featcal's default),
# texts cut at 2048 tokens (featcal's default max_length; the padded length is the longest text's, at most
# that), batches of 16 (featcal's default).
LLAMA_3B = Shape(3072, 8192, 28, 24, 8, 128256, True, tasks=5, examples=256, length=2048, batch=16)
LLAMA_8B = Shape(4096, 14336, 32, 32, 8, 128256, False, tasks=5, examples=256, length=2048, batch=16)


def _carved(sizes: list[int]) -> int:
    return sum(-(-nbytes // ALIGNMENT) * ALIGNMENT for nbytes in sizes)


def _triangle(dim: int, cross: int) -> tuple[int, int]:
    """Elements of a Gram accumulator's blocks (``GramAccumulator``) and of its first (widest) block."""
    count = max(1, min(8, dim // 384))
    size = -(-dim // count)
    blocks = [(start, min(start + size, dim)) for start in range(0, dim, size)]
    elements = [(stop - start) * (dim + cross - start) for start, stop in blocks]
    return sum(elements), elements[0]


def predict(s: Shape) -> dict[str, float]:
    """The formula: bytes held by one process of a calibration of shape ``s`` on its device, by term and
    by phase (the persistent terms plus what the phase adds).

    Args:
        s: The model and the calibration.

    Returns:
        ``terms`` (bytes of each term) and ``phases`` (each phase's peak), as a flat mapping.
    """
    d, i, h, kv, n, L, T = (
        s.hidden,
        s.intermediate,
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.per_process,
        s.length,
        s.tasks,
    )
    b = min(s.batch, n)
    tokens = b * L  # one forward batch
    # linear groups: (dim, cross, out) for q/k/v, o_proj, gate/up (inputs crossed) and down_proj (outputs)
    linear = [(d, d, h + 2 * kv), (h, h, d), (d, d, 2 * i)]
    projected = [(i, d, d)]
    groups = linear + projected
    capacity = min(max(1, STATISTICS_CHUNK_TOKENS // tokens), -(-n // b)) * tokens
    params = d * (h + 2 * kv) + h * d + 3 * d * i + 2 * d  # one decoder layer
    task_streams = 2 * n * L * d * F32  # one task's student and expert features, float32
    visiting = s.resident < T  # some task's streams are in host memory and visit the device while used
    terms = {
        "streams": s.resident * task_streams,  # those of the tasks kept on the device
        "context": T * n * L * (8 + F32),  # attention masks (int64) and token weights
        "embedding": s.vocab * d * F32 * (1 if s.tied else 2) + d * F32,  # embedding (and untied head), final norm
        "layers": 2 * params * F32,  # the merged layer and the expert's copy, float32
    }
    joint = capacity * F32 * sum(dim + cross for dim, cross, _ in groups)
    borrowed = _carved(
        [dim * dim * F64 for dim in {g[0] for g in groups}] + [4] + [dim * dim * F32 for dim, *_ in projected]
    )
    grams = [_triangle(dim, cross) for dim, cross, _ in groups]
    terms["joint_buffers"] = max(joint, borrowed) + len(groups) * capacity * F32  # + each group's row weights
    terms["gram_accumulators"] = sum(e for e, _ in grams) * F32 + sum(dim + cross for dim, cross, _ in groups) * F64
    terms["moments"] = F64 * (
        sum(2 * dim * dim + 2 * dim for dim, _, _ in linear) + i * i + i * d + i + d + 2 * (2 * d + 1)
    )
    terms["systems"] = F64 * (sum(dim * dim + dim * out + dim for dim, _, out in groups) + 2 * 2 * d)
    terms["scratch"] = max(first for _, first in grams) * F64
    persistent = sum(terms.values())
    # The statistics forwards of one batch: the student's recorded inputs (to down_proj's, where it stops:
    # 4d + I per token), the expert's recorded inputs and outputs (its norm's, q/k/v, attention, o_proj,
    # residual, second norm: 6d + 2kv) and its MLP (gate, up, the activation and their product, 4I; then
    # down_proj's output and the layer's, 2d); the batch's causal mask (b·L² booleans).
    forwards = tokens * F32 * (12 * d + 2 * kv + 5 * i) + b * L * L
    # A task's fold: C_sτ·W_tᵀ built in float64 and float32 for the widest group.
    fold = max(
        max(F64 * dim * dim + F32 * dim * dim + (F32 + F64) * dim * out for dim, _, out in linear),
        max((F32 + F64) * dim * out for dim, _, out in projected),
    )
    # The solves: every group's solution in float64 until the layer is written, and, for the largest group,
    # its anchors (merged and base weights, their blend: float32), the right-hand side and its solution
    # (float64); the base layer's file pages mapped while it is read (bfloat16: host memory on a GPU).
    solve = F64 * params + max(dim * out * (3 * F32 + 2 * F64) for dim, _, out in groups) + 2 * params
    # The student's advance: a forward without recording (the MLP's 4I and the layer's outputs, 4d).
    advance = tokens * F32 * (4 * d + 4 * i) + b * L * L
    # Layer 0's inputs: the expert's copy of the embedding and one batch's stem outputs, before any layer.
    first = terms["embedding"] + s.vocab * d * F32 + terms["streams"] + terms["context"] + 2 * tokens * d * F32
    # A task kept in host memory visits the device: both its streams while its statistics are gathered and
    # folded, its merged-model stream while it is advanced.
    visit_statistics, visit_advance = (task_streams, task_streams // 2) if visiting else (0, 0)
    phases = {
        "first_inputs": first,
        "statistics": persistent + forwards + visit_statistics,
        "fold": persistent + fold + visit_statistics,
        "solve": persistent + solve,
        "advance": persistent + advance + visit_advance,
    }
    return {
        **{f"term_{k}": v for k, v in terms.items()},
        "term_forward_batch": forwards,
        "term_fold": fold,
        "term_solve": solve,
        "term_advance": advance,
        "term_visiting_task": visit_statistics,
        "host_streams": (T - s.resident) * task_streams,  # in host memory, not in the device's peak
        **{f"phase_{k}": v for k, v in phases.items()},
        "peak": max(phases.values()),
        "peak_phase": max(phases, key=phases.get),
    }


# --- building the models -------------------------------------------------------------------------


def llama_config(s: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=max(2 * s.length, 128),
        tie_word_embeddings=s.tied, pad_token_id=0, dtype="bfloat16",
    )  # fmt: skip


def build(s: Shape, folder: Path) -> None:
    """A random bfloat16 base, ``s.tasks`` experts (base + noise) and their Task Arithmetic merge (κ 0.3)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(s)).eval()
    base.to(torch.bfloat16).save_pretrained(folder / "base")
    state = {k: v.float() for k, v in base.state_dict().items()}
    merged = {k: v.clone() for k, v in state.items()}
    for t in range(s.tasks):
        expert = LlamaForCausalLM(llama_config(s)).eval()
        with torch.no_grad():
            for key, value in expert.state_dict().items():
                tau = 0.01 * torch.randn_like(state[key])
                value.copy_(state[key] + tau)
                merged[key] += 0.3 * tau
        expert.to(torch.bfloat16).save_pretrained(folder / f"expert{t}")
    with torch.no_grad():
        for key, value in base.state_dict().items():
            value.copy_(merged[key])
    base.to(torch.bfloat16).save_pretrained(folder / "merged")


# --- the measurement (in a child process) --------------------------------------------------------


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class PhasePeaks:
    """The resident-set peak inside chosen methods, by label; a method called inside another's phase
    (the folds inside the statistics) ends that phase's measure and starts its own, then hands back."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.stack: list[str] = []

    def _credit(self) -> None:
        if self.stack:
            label = self.stack[-1]
            self.peaks[label] = max(self.peaks.get(label, 0), _hwm())
        _reset_hwm()

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def measured(*args, **kwargs):
            self._credit()
            self.stack.append(label)
            try:
                return original(*args, **kwargs)
            finally:
                self._credit()
                self.stack.pop()

        setattr(owner, name, measured)


WARM_UP = Shape(64, 128, 1, 4, 2, 128, False, tasks=1, examples=4, length=16, batch=4)


def child(shape: Shape, folder: Path, out: Path) -> dict:
    """One streamed calibration of ``folder``'s merge, with each phase's resident peak (bytes above the
    resident set before it) and the calibration's seconds. A calibration of a tiny Llama runs first, so
    that what every process holds once whatever the model (modules imported on first use, the BLAS and
    LAPACK buffers, thread pools) is in the resident set before, not counted in the peaks."""
    import torch

    import featcal.calibration.driver as driver
    from featcal.calibration.adapters import CalibrationBatch
    from featcal.calibration.params import FeatCalParams
    from featcal.calibration.streaming import featcal_calibrate_folder
    from featcal.families import get_family
    from featcal.memory import host_rss_bytes, release_free_memory

    family = get_family("causal_lm")

    def calibrate(s: Shape, models: Path, written: Path) -> None:
        generator = torch.Generator().manual_seed(1)
        batches = {}
        for t in range(s.tasks):  # lengths L/2..L, one text of L: every task padded to L
            n, L = s.per_process, s.length
            lengths = torch.randint(L // 2, L + 1, (n,), generator=generator)
            lengths[0] = L
            mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
            ids = torch.randint(1, s.vocab, (n, L), generator=generator) * mask
            batches[f"t{t}"] = CalibrationBatch({"input_ids": ids}, {"attention_mask": mask}, mask.float())
        experts = {f"t{t}": family.checkpoint(models / f"expert{t}") for t in range(s.tasks)}
        params = FeatCalParams(num_calibration_examples=s.per_process, calibration_batch_size=s.batch)
        if s.stream_storage == "auto":
            raise ValueError("a measured shape keeps every task's streams on the device or none")
        featcal_calibrate_folder(
            family, models / "merged", written, family.checkpoint(models / "base"), experts, batches.__getitem__,
            params, config=family.model_config(models / "base"), progress=False, stream_storage=s.stream_storage,
        )  # fmt: skip

    if not (folder.parent / "warm-up" / "merged").is_dir():
        build(WARM_UP, folder.parent / "warm-up")
    calibrate(WARM_UP, folder.parent / "warm-up", out)
    peaks = PhasePeaks()
    peaks.wrap(driver.FeatCalibrator, "_all_first_inputs", "first_inputs")
    peaks.wrap(driver.FeatCalibrator, "_collect", "statistics")
    peaks.wrap(driver, "fold_task", "fold")
    peaks.wrap(driver.FeatCalibrator, "_solve_into", "solve")
    peaks.wrap(driver.FeatCalibrator, "_advance", "advance")
    release_free_memory()
    before = host_rss_bytes()
    _reset_hwm()
    start = time.perf_counter()
    calibrate(shape, folder, out)
    seconds = time.perf_counter() - start
    whole = _hwm()
    return {
        "calibration_s": round(seconds, 1),
        "rss_before": before,
        "measured_peak": max([whole, *peaks.peaks.values()]) - before,
        **{f"measured_{k}": v - before for k, v in peaks.peaks.items()},
    }


def measure(name: str, shape: Shape, work: Path, featcal_allocator: bool) -> dict:
    """Build ``shape``'s models in ``work`` (once) and measure one calibration of them in a child process."""
    folder = work / name
    if not (folder / "merged").is_dir():
        build(shape, folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    if not featcal_allocator:
        env.update({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0"})
    allocator = "from featcal.allocator import keep_freed_memory_for_reuse; keep_freed_memory_for_reuse(); "
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import lm_memory as m; "
        + (allocator if featcal_allocator else "")
        + "s = m.Shape(**json.loads(sys.argv[2])); "
        "print(json.dumps(m.child(s, m.Path(sys.argv[3]), m.Path(sys.argv[4]))))"
    )
    out = work / f"{name}-calibrated"
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(asdict(shape)), str(folder), str(out)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{name}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


PHASES = ("first_inputs", "statistics", "fold", "solve", "advance")


def compare(predicted: dict, measured: dict) -> dict:
    """Measured / predicted, for the whole calibration and each phase. On the CPU the host streams are in
    the same memory as the device's terms: they are added to every prediction."""
    host = predicted["host_streams"]
    out = {"peak": round(measured["measured_peak"] / (predicted["peak"] + host), 3)}
    for phase in PHASES:
        if f"measured_{phase}" in measured:
            out[phase] = round(measured[f"measured_{phase}"] / (predicted[f"phase_{phase}"] + host), 3)
    return out


def gibibytes(values: dict) -> dict:
    """Byte counts in GiB, other values (seconds, names) as they are."""
    return {
        k: round(v / GIB, 3) if isinstance(v, int | float) and not k.endswith("_s") else v for k, v in values.items()
    }


# What the docs tabulate for each Llama: MergeBench's size with every task padded to the 2048-token limit
# (the worst case), the same over 2 processes or in batches of 4, and two smaller sizes.
SETTINGS = {
    "n 256, L 2048": {},
    "n 256, L 2048, 2 processes": {"processes": 2},
    "n 256, L 2048, batches of 4": {"batch": 4},
    "n 256, L 1024": {"length": 1024},
    "n 128, L 2048": {"examples": 128},
    "n 256, L 2048, streams in host memory": {"resident_tasks": 0},
}
GPU_GIB = 80  # the card of the setting --stream-storage auto is shown on


def auto_resident(s: Shape, device_gib: float = GPU_GIB) -> Shape:
    """``s`` with the tasks ``--stream-storage auto`` keeps on a CUDA device of ``device_gib`` GiB: as many
    as fit in ``AUTO_DEVICE_SHARE`` of its memory (:class:`featcal.calibration.stream_storage.StreamPlacement`)."""
    from featcal.calibration.stream_storage import AUTO_DEVICE_SHARE

    task_streams = 2 * s.per_process * s.length * s.hidden * F32
    return replace(s, resident_tasks=min(s.tasks, int(AUTO_DEVICE_SHARE * device_gib * GIB // task_streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lm_memory"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--shapes", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    parser.add_argument("--featcal-allocator", action="store_true", help="featcal's glibc settings in the child")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from allocator_speed import write_report
    from calibration_floor import environment

    measured = {}
    for name in args.shapes:
        shape = MEASURED[name]
        predicted = predict(shape)
        result = measure(name, shape, args.workdir, args.featcal_allocator)
        measured[name] = {
            "shape": asdict(shape),
            "predicted_gib": gibibytes(predicted),
            "measured_gib": gibibytes(result),
            "measured_over_predicted": compare(predicted, result),
        }
        print(name, json.dumps(measured[name]["measured_over_predicted"]), f"{result['calibration_s']} s", flush=True)
    llamas = {}
    for label, shape in (("Llama-3.2-3B", LLAMA_3B), ("Llama-3.1-8B", LLAMA_8B)):
        settings = {name: replace(shape, **changes) for name, changes in SETTINGS.items()}
        settings[f"n 256, L 2048, auto on an {GPU_GIB} GiB GPU"] = auto_resident(shape)
        for setting, s in settings.items():
            llamas[f"{label}, {setting}"] = {"shape": asdict(s), "predicted_gib": gibibytes(predict(s))}
    write_report(
        args.out, __doc__, allocator="featcal's" if args.featcal_allocator else "glibc, mmap threshold 64 KiB",
        measured=measured, formula=llamas, environment=environment(os.cpu_count() or 1),
    )  # fmt: skip
    for label, entry in llamas.items():
        p = entry["predicted_gib"]
        print(
            f"{label}: peak {p['peak']} GiB ({p['peak_phase']}), streams {p['term_streams']} GiB on the device, "
            f"{p['host_streams']} GiB in host memory"
        )


if __name__ == "__main__":
    main()
