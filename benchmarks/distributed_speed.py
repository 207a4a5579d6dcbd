"""`featcal run` in one process against two processes under torchrun, on a small random CLIP.

Builds offline, in a work folder: a random CLIPModel (vision tower 6 layers × 384 wide, 96 px images
in 16 px patches, so 37 tokens; a small text tower over a byte-level tokenizer), one expert per task
(base + a random task vector) and one parquet dataset per task in the Hub layout. Then runs the whole
pipeline (merge, evaluate, FeatCal, evaluate) three ways on the same inputs:

* one process, one thread;
* one process, two threads (the fair comparison on a 2-core machine);
* two processes under ``torchrun --standalone --nproc-per-node 2`` (gloo), one thread each.

    .venv/bin/python benchmarks/distributed_speed.py                     # 4 tasks, 64 + 256 images each
    .venv/bin/python benchmarks/distributed_speed.py --tasks 2 --train 16 --test 32   # a quick check

Writes ``benchmarks/results/distributed_speed.json`` (``--out``): wall seconds of each command, the
stage times of its ``timings.json``, and how far the calibrated weights of each run are from the
first's (‖ΔW‖ / ‖update‖).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def build_inputs(root: Path, tasks: int, train: int, test: int) -> Path:
    """base/, experts/t*/, data/t*/ and tasks.json under ``root``; returns the tasks file."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    sys.path.insert(0, str(REPO))
    from tests.support.builders import byte_level_tokenizer, save_dataset, save_expert

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=514, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, bos_token_id=512, eos_token_id=513, pad_token_id=513,
        ),
        vision_config=dict(
            hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6, image_size=96,
            patch_size=16,
        ),
        projection_dim=128,
    )  # fmt: skip
    base = CLIPModel(config).eval()
    base.save_pretrained(root / "base")
    byte_level_tokenizer().save_pretrained(root / "base")
    CLIPImageProcessor(size={"shortest_edge": 96}, crop_size={"height": 96, "width": 96}).save_pretrained(root / "base")
    table = {}
    for i in range(tasks):
        name = f"t{i}"
        classes = [f"kind{i}x{c}" for c in range(10)]
        save_expert(base, root / "experts" / name, seed=100 + i)
        save_dataset(root / "data" / name, classes, train=train, test=test, seed=200 + i)
        table[name] = {
            "dataset": {"path": f"data/{name}"},
            "expert": f"experts/{name}",
            "classnames": classes,
            "templates": ["a photo of a {}.", "a picture of {}."],
        }
    tasks_file = root / "tasks.json"
    tasks_file.write_text(json.dumps({"base_model": "base", "tasks": table}, indent=1))
    return tasks_file


def run(label: str, launcher: list[str], threads: int, tasks_file: Path, out: Path, train: int) -> dict:
    """One `featcal run`; its wall time, exit status and the run folder's timings."""
    env = dict(
        os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    args = [
        "-q", "run", "--tasks-file", str(tasks_file), "--output-dir", str(out), "--device", "cpu",
        "--num-calibration-examples", str(train), "--calibration-batch-size", "16", "--eval-batch-size", "64",
        "--eval-num-workers", "0", "--no-export",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([*launcher, "-m", "featcal", *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{label} failed:\n{done.stderr[-4000:]}")
    timings = json.loads((out / "timings.json").read_text())
    return {"label": label, "threads_per_process": threads, "wall_s": round(seconds, 2), "timings": timings}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def distance(reference: Path, other: Path) -> float:
    """‖W_other − W_reference‖ / ‖W_reference − W_merged‖ over the calibrated model."""
    from safetensors.torch import load_file

    a = load_file(str(reference / "featcal-ta" / "model.safetensors"))
    merged = load_file(str(reference / "ta" / "model.safetensors"))
    b = load_file(str(other / "featcal-ta" / "model.safetensors"))
    diff = sum(float((b[k].double() - a[k].double()).square().sum()) for k in a)
    update = sum(float((a[k].double() - merged[k].double()).square().sum()) for k in a)
    return (diff / update) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--train", type=int, default=64, help="calibration images per task")
    parser.add_argument("--test", type=int, default=256, help="test images per task")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three runs, interleaved")
    parser.add_argument("--out", type=Path, default=RESULTS / "distributed_speed.json")
    args = parser.parse_args()
    import torch

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="featcal-distributed-") as work:
        root = Path(work)
        tasks_file = build_inputs(root / "inputs", args.tasks, args.train, args.test)
        python = [sys.executable]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        configs = [
            ("1 process, 1 thread", python, 1),
            ("1 process, 2 threads", python, 2),
            ("2 processes (torchrun, gloo), 1 thread each", torchrun, 1),
        ]
        runs = [{"label": label, "threads_per_process": threads, "wall_s": []} for label, _, threads in configs]
        for repeat in range(args.repeats):  # interleaved, so that each configuration sees the same load
            for i, (label, launcher, threads) in enumerate(configs):
                done = run(label, launcher, threads, tasks_file, root / f"{repeat}-{i}", args.train)
                runs[i]["wall_s"].append(done["wall_s"])
                runs[i].setdefault("timings", []).append(done["timings"])
        for i, entry in enumerate(runs):
            entry["weights_vs_first"] = distance(root / "0-0", root / f"0-{i}")
    result = {
        "command": " ".join(["python", "benchmarks/distributed_speed.py", *sys.argv[1:]]),
        "shape": "CLIP vision 6 layers x 384, 96 px / 16 px patches (37 tokens), text 2 x 128",
        "tasks": args.tasks,
        "calibration_images_per_task": args.train,
        "test_images_per_task": args.test,
        "environment": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for entry in runs:
        calibrate = [t["calibrate_s"] for t in entry["timings"]]
        print(
            f"{entry['label']:<46} wall {min(entry['wall_s']):7.1f} s (of {entry['wall_s']}), calibrate "
            f"{min(calibrate):6.1f} s, ΔW/update {entry['weights_vs_first']:.1e}"
        )


if __name__ == "__main__":
    main()
