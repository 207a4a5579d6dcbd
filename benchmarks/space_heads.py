"""The Space's class heads for the eight TA8 tasks: the first start (computed) and the next (read back).

A random CLIP model of ViT-B/32's configuration (``CLIPModel(CLIPConfig())``: a 12-layer, 512-wide text
tower, 77 positions) computes the heads of the eight TA8 tasks (3,727 prompts) with featcal's
``featcal.space.heads.task_heads`` and ``ZeroShotClassifier`` into an empty cache folder, then reads
them back from it. Nothing is downloaded, so the tokenizer is the tests' byte-level CLIPTokenizer
(one token a byte, cut at 77): its sequences are several times longer than the real CLIP BPE
tokenizer's, so the first start measured here is an upper bound of the real one's on the same CPU.

    .venv/bin/python benchmarks/space_heads.py --workdir /tmp/space_heads --out benchmarks/results/space_heads.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from calibration_floor import environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise KeyError("VmHWM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="an empty or missing folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import torch
    from transformers import CLIPConfig, CLIPModel

    from featcal.families.clip_vision.entries import image_classes
    from featcal.families.clip_vision.evaluation import ZeroShotClassifier
    from featcal.space.heads import task_heads
    from featcal.suites import suite_table
    from tests.support.builders import byte_level_tokenizer

    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=False)
    base, cache = args.workdir / "base", args.workdir / "space-heads"
    config = CLIPConfig()
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    tokenizer = byte_level_tokenizer(config.text_config.max_position_embeddings)
    config.save_pretrained(str(base))  # what identifies the base in the cache key
    tokenizer.save_pretrained(str(base))
    tasks = list(suite_table("ta8").tasks.values())
    prompts = [p for t in map(image_classes, tasks) for c in t.classnames for p in t.prompts(c)]
    lengths = [len(ids) for ids in tokenizer(prompts, truncation=True)["input_ids"]]

    before = environment(args.threads)  # machine, versions, threads and the load average now
    timings = {}
    for start in ("first_start", "next_start"):
        classifier = ZeroShotClassifier(model, tokenizer)
        begin = time.perf_counter()
        heads = task_heads(classifier, tasks, base, cache, progress=False)
        timings[start] = round(time.perf_counter() - begin, 4)
        print(f"{start:<12} {timings[start]:10.4f} s", flush=True)
    results = {
        "seconds": timings,
        "tasks": len(tasks),
        "prompts": len(prompts),
        "byte_tokens_per_prompt": {"mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "head_shapes": {name: list(head.shape) for name, head in heads.items()},
        "peak_rss_gib": round(_peak_rss_gib(), 3),
        "environment": before,
        "load_average_after": os.getloadavg(),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
