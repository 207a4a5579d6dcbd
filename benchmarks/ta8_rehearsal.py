"""The full TA8 shape on CPU: `featcal run` on a random ViT-B/32-shaped CLIP, eight experts, eight datasets.

Builds, offline and once (reused from ``--workdir`` with ``--keep``):

- ``base/``: a random ``CLIPModel`` with openai/clip-vit-base-patch32's configuration (vision: hidden
  768, 12 layers, 12 heads, MLP 3072, patch 32, 224 px; text: hidden 512, 12 layers, 8 heads, MLP 2048,
  vocabulary 49408, 77 positions; projection 512), a CLIP BPE tokenizer built in code (vocabulary
  49408: the 512 byte tokens, merges learnt from the TA8 prompts so that every word of a prompt is one
  token, as in the real vocabulary, unused fillers, and the special tokens at 49406/49407) and a
  ``CLIPImageProcessor`` (224 px);
- ``experts/<task>/``: the base's vision tower plus a random task vector (0.05 × each tensor's std),
  as ``CLIPVisionModel`` folders;
- ``data/<task>/``: parquet datasets in the Hub layout with the TA8 task names, class names and class
  counts (397, 196, 45, 10, 10, 43, 10, 47), 224 px procedural PNG images (``datasets.Image``):
  ``--images-per-task`` train images (the calibration n) and ``--test-images`` test images per task;
- ``tasks.json``: the task table, with the real templates of ``featcal/resources/ta8_tasks.json``.

Then runs the real command line in a child process (``python -m featcal run … --device cpu``, the
reference hyper-parameters: Task Arithmetic κ 0.3, n = 256, batch 16), samples the child's RSS and
CPU time from /proc every 0.2 s, timestamps its progress lines, and attributes the samples to the
stages (start-up, merge, evaluations, calibration, export) with the run folder's ``timings.json``.
The whole-process peak RSS is the child's ``ru_maxrss`` (``wait4``). The FLOP floor of the same
calibration comes from ``calibration_floor.py``'s counts and this machine's matmul rates, measured
just before and after the run.

    nice -n 5 .venv/bin/python benchmarks/ta8_rehearsal.py                       # the full shape, ~12 min
    .venv/bin/python benchmarks/ta8_rehearsal.py --tasks mnist eurosat --images-per-task 16 \\
        --test-images 16 --output /tmp/small.json                                  # a quick check

Writes ``benchmarks/results/ta8_rehearsal.json`` (``--output``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from calibration_floor import RESULTS, ViTShape, count_work, floor_seconds, measure_matmul_gflops, measure_read_rate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TA8_TABLE = REPO / "featcal" / "resources" / "ta8_tasks.json"
TA8 = ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
BUILD_VERSION = 1  # bump when the built inputs change
TASK_VECTOR_SCALE = 0.05  # task vector entries: this × the tensor's std × N(0, 1), as calibration_speed.py
IMAGE_SIZE = 224
SAMPLE_INTERVAL_S = 0.2
GIB = 2**30

# The published code's numbers as issue 18 gives them (calibration only, 2-core CPU, ViT-B/32 shape);
# the published code is not in this repository and was not rerun here.
PUBLISHED_CODE = {
    "seconds_per_calibration_image": 0.5,
    "solves_seconds": 15.0,
    "extrapolated_8x256_minutes": 18.0,
    "peak_rss_GB_at_2x16": 3.0,
    "cpu_rss_GiB_in_its_gpu_run": 22.8,
    "source": "issue 18 and benchmarks/README.md (FeatCal calibration); measured on the 2-core AMD EPYC "
    "machine of the earlier benchmarks, calibration only (no evaluation, no export)",
}


# -- the inputs ------------------------------------------------------------------------------
def clip_config():
    """openai/clip-vit-base-patch32's configuration (transformers' CLIPConfig defaults are that model's
    sizes; the token ids are the published config's, which select the argmax pooling of the text tower)."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=49408,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=8,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=IMAGE_SIZE,
            patch_size=32,
            hidden_act="quick_gelu",
        ),
        projection_dim=512,
    )


def _bytes_to_unicode() -> list[str]:
    """CLIP's (GPT-2's) byte → printable character table, in CLIP's vocabulary order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def build_tokenizer(prompts: list[str], vocab_size: int = 49408):
    """A CLIPTokenizer in the real vocabulary's layout: 256 byte tokens, 256 byte+``</w>`` tokens, one
    token per BPE merge (learnt from ``prompts`` until every word is one token), unused fillers, then
    ``<|startoftext|>`` and ``<|endoftext|>`` at the last two ids."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": i + 256 for i, c in enumerate(chars)}
    seed = CLIPTokenizer(vocab=vocab | {"<|startoftext|>": 512, "<|endoftext|>": 513}, merges=[])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        special_tokens=[],
    )
    backend = seed.backend_tokenizer  # CLIP's normaliser and pre-tokeniser
    backend.train_from_iterator(prompts, trainer=trainer)
    learnt = json.loads(backend.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) > vocab_size - 2:
        raise SystemExit(f"{len(vocab)} learnt tokens do not fit a vocabulary of {vocab_size}")
    for index in range(len(vocab), vocab_size - 2):
        vocab[f"<|unused{index}|>"] = index
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = vocab_size - 2, vocab_size - 1
    return CLIPTokenizer(vocab=vocab, merges=merges), len(merges)


def _image(rng, label: int, classes: int):
    """A 224 px RGB image: a class-coloured plane wave (class-dependent direction and frequency), a
    random phase, and noise."""
    import numpy as np
    from PIL import Image

    hue = (label * 0.618034) % 1.0
    color = 255 * np.clip(np.abs((hue * 6 + np.array([0.0, 4.0, 2.0])) % 6 - 3) - 1, 0, 1)
    fx, fy = 1 + label % 7, 1 + (label // 7) % 7
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / IMAGE_SIZE
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * (fx * xx + fy * yy) + rng.uniform(0, 2 * np.pi))
    pixels = 40 + 0.7 * color * wave[..., None] + rng.normal(0, 12, (IMAGE_SIZE, IMAGE_SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def build_dataset(folder: Path, classes: list[str], train: int, test: int, seed: int) -> bool:
    """data/{train,test}-00000-of-00001.parquet with columns image (PNG) and label (ClassLabel); False
    when the folder already holds them."""
    import numpy as np
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    meta = {"version": BUILD_VERSION, "train": train, "test": test, "classes": len(classes), "size": IMAGE_SIZE}
    if (folder / "meta.json").is_file() and json.loads((folder / "meta.json").read_text()) == meta:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=classes)})
    for split, count, offset in (("train", train, 0), ("test", test, 1)):
        labels = [(3 * i + offset) % len(classes) for i in range(count)]
        images = [_image(rng, label, len(classes)) for label in labels]
        Dataset.from_dict({"image": images, "label": labels}, features=features).to_parquet(
            str(folder / "data" / f"{split}-00000-of-00001.parquet")
        )
    (folder / "meta.json").write_text(json.dumps(meta))
    return True


def build_inputs(workdir: Path, tasks: list[str], train: int, test: int, seed: int = 0) -> dict:
    """Base, experts, datasets and tasks file under ``workdir``; parts already there are kept."""
    import torch
    from transformers import CLIPImageProcessor, CLIPModel, CLIPVisionModel

    table = json.loads(TA8_TABLE.read_text())["tasks"]
    started, built = time.perf_counter(), []
    base_dir = workdir / "base"
    marker = base_dir / "featcal_rehearsal.json"
    base = None
    if not (marker.is_file() and json.loads(marker.read_text()).get("version") == BUILD_VERSION):
        shutil.rmtree(base_dir, ignore_errors=True)
        prompts = [t.format(c) for task in table.values() for c in task["classnames"] for t in task["templates"]]
        tokenizer, merges = build_tokenizer(prompts)
        torch.manual_seed(seed)
        base = CLIPModel(clip_config()).eval()
        base.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ).save_pretrained(base_dir)
        marker.write_text(json.dumps({"version": BUILD_VERSION, "merges": merges, "prompts": len(prompts)}))
        built.append("base")
    for task in tasks:
        folder = workdir / "experts" / task
        if (folder / "config.json").is_file():
            continue
        if base is None:
            base = CLIPModel.from_pretrained(str(base_dir)).eval()
        generator = torch.Generator().manual_seed(seed + 100 + TA8.index(task))
        state = {}
        for key, value in base.vision_model.state_dict().items():
            scale = TASK_VECTOR_SCALE * value.std().nan_to_num(0.02).clamp_min(0.02) if value.is_floating_point() else 0
            state[key] = value + scale * torch.randn(value.shape, generator=generator) if scale else value
        expert = CLIPVisionModel(base.config.vision_config)
        expert.load_state_dict(state)
        expert.save_pretrained(folder)
        del expert, state
        built.append(f"experts/{task}")
    for task in tasks:
        if build_dataset(workdir / "data" / task, table[task]["classnames"], train, test, seed + 200 + TA8.index(task)):
            built.append(f"data/{task}")
    tasks_table = {
        name: {
            "dataset": {"path": str(workdir / "data" / name)},
            "expert": str(workdir / "experts" / name),
            "classnames": table[name]["classnames"],
            "templates": table[name]["templates"],
        }
        for name in TA8
        if (workdir / "data" / name / "meta.json").is_file()
    }
    (workdir / "tasks.json").write_text(json.dumps({"base_model": str(base_dir), "tasks": tasks_table}, indent=1))
    return {"built": built, "seconds": time.perf_counter() - started}


# -- the measured run ------------------------------------------------------------------------
def _proc_sample(pid: int) -> dict | None:
    """VmRSS, VmHWM, RssAnon, RssFile (bytes) and user+system CPU seconds of a live process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    sample = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            sample[key] = int(value.split()[0]) * 1024
    fields = stat.rpartition(")")[2].split()
    sample["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return sample if "VmRSS" in sample else None


def run_measured(cmd: list[str], env: dict, cwd: Path, log: Path) -> dict:
    """Run ``cmd``; return its wall time, ``ru_maxrss``, CPU time, /proc samples and timestamped stderr."""
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout: list[str] = []

    def read_stderr() -> None:
        with log.open("w") as sink:
            for line in proc.stderr:
                lines.append((time.perf_counter() - start, line.rstrip("\n")))
                sink.write(f"{lines[-1][0]:9.2f} {line}")
                sink.flush()

    def read_stdout() -> None:
        stdout.extend(proc.stdout)

    readers = [threading.Thread(target=read_stderr), threading.Thread(target=read_stdout)]
    for reader in readers:
        reader.start()
    samples = []
    while True:
        sample = _proc_sample(proc.pid)
        if sample is not None:
            samples.append({"t": time.perf_counter() - start, **sample})
        finished, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if finished:
            break
        time.sleep(SAMPLE_INTERVAL_S)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join()
    return {
        "wall_s": wall,
        "returncode": proc.returncode,
        "ru_maxrss_bytes": usage.ru_maxrss * 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "samples": samples,
        "stderr": lines,
        "stdout": "".join(stdout),
    }


def _first(lines: list[tuple[float, str]], pattern: str, nth: int = 0) -> float | None:
    hits = [t for t, line in lines if re.search(pattern, line)]
    return hits[nth] if len(hits) > nth else None


def stage_windows(result: dict, timings: dict[str, float], merge_method: str = "task_arithmetic") -> list[dict]:
    """[start, end) of each stage on the child's clock, from the progress lines that end the
    evaluations, the calibration and the export, and the durations in ``timings.json``."""
    from featcal.runfolder.layout import calibrated_stage_name, merged_stage_name

    lines, end = result["stderr"], result["wall_s"]
    merged, calibrated = merged_stage_name(merge_method), calibrated_stage_name(merge_method)
    eval_done = r"featcal\.progress: Evaluating tasks: done"
    eval_ta_end = _first(lines, eval_done, 0)
    eval_fc_end = _first(lines, eval_done, 1)
    calibrated_end = _first(lines, r"FeatCal: layers: done")
    exported = _first(lines, r"featcal\.release\.export: Exported ")
    if None in (eval_ta_end, eval_fc_end, calibrated_end, exported):
        raise SystemExit("the run's progress lines are not all there: see the log")
    eval_ta_start = eval_ta_end - timings[f"eval_{merged}_s"]
    merge_start = eval_ta_start - timings["merge_s"]
    calibrate_end = eval_ta_end + timings["calibrate_s"]
    eval_fc_start = eval_fc_end - timings[f"eval_{calibrated}_s"]
    bounds = [
        ("start-up (imports, inputs and datasets checked, base CLIP loaded)", 0.0, merge_start),
        ("merge (Task Arithmetic, saved)", merge_start, eval_ta_start),
        (f"evaluate {merged} (with the text heads)", eval_ta_start, eval_ta_end),
        ("calibrate (FeatCal, with loading the calibration images)", eval_ta_end, calibrate_end),
        ("after the calibration (its folder in place, stage recorded)", calibrate_end, eval_fc_start),
        (f"evaluate {calibrated}", eval_fc_start, eval_fc_end),
        ("export (release folder, card, plot)", eval_fc_end, exported),
        ("exit (table, interpreter shutdown)", exported, end),
    ]
    windows = []
    samples = result["samples"]
    for name, start, stop in bounds:
        inside = [s for s in samples if start <= s["t"] < stop]
        before = [s for s in samples if s["t"] < start]
        peak = max(inside, key=lambda s: s["VmRSS"]) if inside else None
        cpu_start = before[-1]["cpu_s"] if before else 0.0
        cpu_end = inside[-1]["cpu_s"] if inside else cpu_start
        windows.append(
            {
                "stage": name,
                "start_s": round(start, 2),
                "seconds": round(stop - start, 2),
                "cpu_s": round(cpu_end - cpu_start, 1),
                "peak_rss_bytes": peak["VmRSS"] if peak else None,
                "peak_rss_anon_bytes": peak["RssAnon"] if peak else None,
                "peak_rss_file_bytes": peak["RssFile"] if peak else None,
                "samples": len(inside),
            }
        )
    return windows


def timeline(samples: list[dict], step_s: float = 5.0) -> dict:
    """The RSS samples condensed to one row per ``step_s`` seconds: the row of the largest VmRSS."""
    rows: dict[int, dict] = {}
    for s in samples:
        slot = int(s["t"] // step_s)
        if slot not in rows or s["VmRSS"] > rows[slot]["VmRSS"]:
            rows[slot] = s
    mib = 2**20
    return {
        "columns": ["t_s", "VmRSS_MiB", "RssAnon_MiB", "RssFile_MiB", "cpu_s"],
        "step_s": step_s,
        "rows": [
            [round(r["t"], 1), r["VmRSS"] // mib, r["RssAnon"] // mib, r["RssFile"] // mib, round(r["cpu_s"], 1)]
            for _, r in sorted(rows.items())
        ],
    }


def calibration_detail(lines: list[tuple[float, str]], calibrate_start: float) -> dict:
    """When the first-layer inputs (calibration images loaded, stems run) and each layer finished."""
    first = _first(lines, r"FeatCal: first-layer inputs: done")
    layers = [
        (int(m.group(1)), t)
        for t, line in lines
        if (m := re.search(r"FeatCal: layers: (\d+)/\d+ layers", line))
        or (m := re.search(r"FeatCal: layers: done, (\d+)/\d+ layers", line))
    ]
    ends: dict[int, float] = {}
    for count, t in layers:
        ends.setdefault(count, t)
    detail = {"first_layer_inputs_s": round(first - calibrate_start, 2) if first is not None else None}
    previous, per_layer = first, {}
    for count in sorted(ends):
        if previous is not None:
            per_layer[count - 1] = round(ends[count] - previous, 2)
        previous = ends[count]
    detail["layer_s"] = per_layer
    detail["note"] = (
        "from progress lines at most one per FEATCAL_PROGRESS_INTERVAL = 1 s: a layer's time is exact when "
        "every layer logged a line"
    )
    return detail


# -- the floor -------------------------------------------------------------------------------
def measure_rates(threads: int, folder: Path) -> dict:
    return {
        "float32": measure_matmul_gflops("float32", threads),
        "float64": measure_matmul_gflops("float64", threads),
        "read": measure_read_rate(400, str(folder)),
        "load_average": os.getloadavg(),
    }


def floors(tasks: int, images: int, rates: list[dict]) -> dict:
    """The engine's work for ``tasks`` × ``images`` at this machine's best measured rates, and the
    recorded floor of ``results/calibration_floor.json`` (another CPU possibly)."""
    work = count_work(ViTShape(), tasks, images, engine=True)
    f32 = max(r["float32"]["best"] for r in rates)
    f64 = max(r["float64"]["best"] for r in rates)
    read = max(r["read"]["cold_GBps"] for r in rates)
    here = floor_seconds(work, f32, f64, read)
    wall_f32 = max(r["float32"]["wall_best"] for r in rates)
    wall_f64 = max(r["float64"]["wall_best"] for r in rates)
    out = {
        "work_TFLOP": work["total_flops"] / 1e12,
        "read_GB": work["read_bytes"] / 1e9,
        "this_machine": {
            "float32_GFLOPs": f32,
            "float64_GFLOPs": f64,
            "read_GBps": read,
            **here,
            "note": "rates: best of before/after the run, per CPU-second × threads (the cores' rate when not shared)",
            "floor_at_wall_clock_rates_s": floor_seconds(work, wall_f32, wall_f64, read)["floor_s"],
        },
        "measurements": rates,
    }
    recorded = RESULTS / "calibration_floor.json"
    if recorded.is_file():
        data = json.loads(recorded.read_text())
        same = data.get("tasks") == tasks and data.get("images") == images
        out["recorded"] = {
            "file": str(recorded.relative_to(REPO)),
            "tasks": data.get("tasks"),
            "images": data.get("images"),
            "covers_this_work": same,
            "floor_s": data["floor"]["engine"]["floor_s"] if same else None,
            "cpu": data["environment"]["cpu"],
            "float32_GFLOPs": data["matmul_gflops"]["float32"]["best"],
        }
    return out


# -- the report ------------------------------------------------------------------------------
def environment(threads: int) -> dict:
    import datasets
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "datasets": datasets.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_total_GiB": round(int(memory.split()[1]) * 1024 / GIB, 1),
        "niceness": os.nice(0),
        "torchvision": _has("torchvision"),
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def table(report: dict) -> str:
    rows = ["| stage | wall (s) | CPU (s) | peak RSS (GiB) |", "|---|---:|---:|---:|"]
    for w in report["stages"]:
        peak = f"{w['peak_rss_bytes'] / GIB:.2f}" if w["peak_rss_bytes"] else "–"
        rows.append(f"| {w['stage']} | {w['seconds']:.1f} | {w['cpu_s']:.0f} | {peak} |")
    run = report["run"]
    rows.append(
        f"| **whole `featcal run`** | **{run['wall_s']:.1f}** | **{run['cpu_s']:.0f}** | "
        f"**{run['peak_rss_bytes'] / GIB:.2f}** |"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/featcal-ta8-rehearsal"))
    parser.add_argument(
        "--images-per-task", type=int, default=256, help="train images per task = the calibration n (default 256)"
    )
    parser.add_argument(
        "--test-images",
        type=int,
        default=256,
        help="test images per task (default 256: one full evaluation batch; the real test sets are larger)",
    )
    parser.add_argument("--tasks", nargs="+", choices=TA8, default=TA8, metavar="TASK", help="default: all eight")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the run")
    parser.add_argument("--calibration-batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="the run's --device (cpu, cuda; default cpu)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (models, datasets, run folder)")
    parser.add_argument("--skip-floor", action="store_true", help="do not measure this machine's matmul rates")
    parser.add_argument("--output", type=Path, default=RESULTS / "ta8_rehearsal.json")
    args = parser.parse_args()
    tasks = [t for t in TA8 if t in args.tasks]
    sys.path.insert(0, str(REPO))  # featcal, for the stage names and the floor's work count

    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    print(f"load average {load_start}; building the inputs in {workdir}", flush=True)
    build_cmd = [sys.executable, str(Path(__file__).resolve()), "--build-only", str(workdir)]
    build_cmd += ["--tasks", *tasks, "--images-per-task", str(args.images_per_task)]
    build_cmd += ["--test-images", str(args.test_images)]
    build = subprocess.run(build_cmd, capture_output=True, text=True, check=False)
    if build.returncode != 0:
        raise SystemExit(f"building the inputs failed:\n{build.stderr[-4000:]}")
    build_info = json.loads(build.stdout.strip().splitlines()[-1])
    print(f"inputs ready in {build_info['seconds']:.0f} s (built: {build_info['built'] or 'nothing, all cached'})")

    rates = [] if args.skip_floor else [measure_rates(args.threads, workdir)]
    run_dir, hf_home = workdir / "run", workdir / "hf-home"
    for folder in (run_dir, hf_home):
        shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "-m", "featcal", "run", "--tasks-file", str(workdir / "tasks.json"), "--tasks", *tasks]
    cmd += ["--base-model-id", str(workdir / "base"), "--device", args.device]
    cmd += ["--num-calibration-examples", str(args.images_per_task)]
    cmd += ["--calibration-batch-size", str(args.calibration_batch_size)]
    cmd += ["--eval-batch-size", str(args.eval_batch_size), "--eval-num-workers", "0", "--output-dir", str(run_dir)]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS=str(args.threads),
        MKL_NUM_THREADS=str(args.threads),
        HF_HOME=str(hf_home),  # a fresh datasets cache: the run prepares its parquet files as a first run would
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        FEATCAL_PROGRESS_INTERVAL="1",
    )
    load_before = os.getloadavg()
    print(f"load average {load_before}; running {' '.join(cmd[2:])}", flush=True)
    result = run_measured(cmd, env, workdir, workdir / "run.log")
    load_after = os.getloadavg()
    if result["returncode"] != 0:
        tail = "\n".join(line for _, line in result["stderr"][-40:])
        raise SystemExit(f"featcal run failed ({result['returncode']}):\n{tail}")
    alone_cmd = [sys.executable, "-m", "featcal", "calibrate", "--tasks-file", str(workdir / "tasks.json")]
    alone_cmd += ["--tasks", *tasks, "--base-model-id", str(workdir / "base"), "--device", args.device]
    alone_cmd += ["--num-calibration-examples", str(args.images_per_task)]
    alone_cmd += ["--calibration-batch-size", str(args.calibration_batch_size)]
    alone_cmd += ["--merged", str(run_dir / "ta"), "--output", str(workdir / "calibrated-alone")]
    print(f"running {' '.join(alone_cmd[2:])}", flush=True)
    alone = run_measured(alone_cmd, env, workdir, workdir / "calibrate.log")
    if alone["returncode"] != 0:
        tail = "\n".join(line for _, line in alone["stderr"][-40:])
        raise SystemExit(f"featcal calibrate failed ({alone['returncode']}):\n{tail}")
    if not args.skip_floor:
        rates.append(measure_rates(args.threads, workdir))
    timings = json.loads((run_dir / "timings.json").read_text())
    stages = stage_windows(result, timings)
    calibrate = next(w for w in stages if w["stage"].startswith("calibrate"))
    peak = result["ru_maxrss_bytes"]
    report = {
        "about": "featcal run on the full TA8 shape on CPU: random ViT-B/32-shaped CLIP (both towers at full "
        "size), random task vectors, procedural 224 px images with the TA8 class names and counts; written by "
        "benchmarks/ta8_rehearsal.py",
        "command": " ".join(["python", *[str(a) for a in sys.argv]]),
        "featcal_command": " ".join(["python", *cmd[1:]]).replace(str(workdir), "$WORKDIR"),
        "environment": environment(args.threads) | {"load_average_start": load_start},
        "load_average_before_run": load_before,
        "load_average_after_run": load_after,
        "setup": {
            "tasks": tasks,
            "classes": {t: len(json.loads(TA8_TABLE.read_text())["tasks"][t]["classnames"]) for t in tasks},
            "train_images_per_task": args.images_per_task,
            "test_images_per_task": args.test_images,
            "image_size": IMAGE_SIZE,
            "calibration_batch_size": args.calibration_batch_size,
            "eval_batch_size": args.eval_batch_size,
            "eval_num_workers": 0,
            "merge": "task_arithmetic, scaling factor 0.3 (the default)",
            "tokenizer": "CLIP BPE built in code, vocabulary 49408 (byte tokens, merges learnt from the TA8 prompts, "
            "unused fillers, specials at 49406/49407); the real OpenAI vocabulary is not available offline",
            "task_vector_scale": TASK_VECTOR_SCALE,
            "build": build_info,
        },
        "run": {
            "wall_s": result["wall_s"],
            "cpu_s": result["cpu_s"],
            "peak_rss_bytes": peak,
            "peak_rss_GiB": peak / GIB,
            "peak_rss_source": "ru_maxrss of the child (wait4): the whole featcal run process",
            "sampled_peak_rss_bytes": max(s["VmRSS"] for s in result["samples"]),
            "samples": len(result["samples"]),
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "timings_json": timings,
        },
        "stages": stages,
        "calibrate_command": {
            "command": " ".join(["python", *alone_cmd[1:]]).replace(str(workdir), "$WORKDIR"),
            "wall_s": alone["wall_s"],
            "cpu_s": alone["cpu_s"],
            "peak_rss_bytes": alone["ru_maxrss_bytes"],
            "peak_rss_GiB": alone["ru_maxrss_bytes"] / GIB,
            "run_peak_over_calibrate_peak": peak / alone["ru_maxrss_bytes"],
            "rss_timeline": timeline(alone["samples"]),
        },
        "calibration": calibration_detail(result["stderr"], calibrate["start_s"])
        | {"seconds_per_task_image": timings["calibrate_s"] / (len(tasks) * args.images_per_task)},
        "published_code": PUBLISHED_CODE
        | {
            "estimate_for_this_work_s": PUBLISHED_CODE["seconds_per_calibration_image"]
            * len(tasks)
            * args.images_per_task
            + PUBLISHED_CODE["solves_seconds"]
        },
        "stdout": result["stdout"],
        "rss_timeline": timeline(result["samples"]),
    }
    (workdir / "samples.json").write_text(json.dumps(result["samples"]))
    if rates:
        floor = floors(len(tasks), args.images_per_task, rates)
        report["floor"] = floor
        floor_s = floor["this_machine"]["floor_s"]
        report["goals"] = {
            "peak_rss_under_4GiB": peak < 4 * GIB,
            "run_peak_at_most_1.1_calibrate_peak": peak <= 1.1 * alone["ru_maxrss_bytes"],
            "calibration_over_floor": timings["calibrate_s"] / floor_s,
            "calibration_over_floor_at_most_1.3": timings["calibrate_s"] / floor_s <= 1.3,
            "calibration_cpu_over_threads_over_floor": calibrate["cpu_s"] / args.threads / floor_s,
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"timings.json: {timings}")
    print(
        f"featcal calibrate alone: {alone['wall_s']:.0f} s, peak RSS {alone['ru_maxrss_bytes'] / GIB:.2f} GiB; "
        f"the run's peak is {peak / alone['ru_maxrss_bytes']:.2f} x that (goal <= 1.1)"
    )
    if rates:
        goals = report["goals"]
        print(
            f"peak RSS {peak / GIB:.2f} GiB (goal < 4: {'met' if goals['peak_rss_under_4GiB'] else 'NOT met'}); "
            f"calibration {timings['calibrate_s']:.0f} s / floor {report['floor']['this_machine']['floor_s']:.0f} s "
            f"= {goals['calibration_over_floor']:.2f} (goal <= 1.3: "
            f"{'met' if goals['calibration_over_floor_at_most_1.3'] else 'NOT met'})"
        )
    print(f"load average before {load_before}, after {load_after}; written {args.output}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


def _build_only() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-only", type=Path)
    parser.add_argument("--tasks", nargs="+")
    parser.add_argument("--images-per-task", type=int)
    parser.add_argument("--test-images", type=int)
    args = parser.parse_args()
    print(json.dumps(build_inputs(args.build_only, args.tasks, args.images_per_task, args.test_images)))


if __name__ == "__main__":
    _build_only() if "--build-only" in sys.argv else main()
