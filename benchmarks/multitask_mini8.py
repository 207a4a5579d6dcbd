"""The multi-task ceiling of the offline mini8 benchmark: one vision tower trained on all eight tasks at once.

    python benchmarks/multitask_mini8.py [--zoo-seed 0] [--tiny] [--steps 1500] [--threads 1]

A merge of the eight experts is one vision tower; this measures how well any one tower of the zoo's
size does on all eight tasks when it is trained on all of them together, the way the experts are
trained on one: a copy of the base's vision tower, fine-tuned through the frozen zero-shot heads
(the base's text tower, templates, visual projection and logit scale) with the zoo's frozen parts
(``ZooConfig.expert_frozen``) kept at the base's values. Each step draws ``--per-task`` training
images of every task and averages the eight cross-entropies. Writes
benchmarks/results/multitask_mini8[_tiny]_seed<S>.json and prints a markdown row (accuracy in %).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from featcal.demo import ZooConfig, build_zoo
from featcal.demo.training import _cosine_lr, accuracy, image_embeddings, zero_shot_head
from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.evaluation import load_base_clip
from featcal.progress import Progress
from featcal.tasks import load_task_file

RESULTS = Path(__file__).parent / "results"


def _pixels(processor, task, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from featcal.families.clip_vision.images import load_task_split

    ds = load_task_split(task, split)
    images = [row["image"].convert("RGB") for row in ds]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    return pixels, torch.tensor(ds["label"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo-seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the test suite's reduced zoo")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--per-task", type=int, default=16, help="training images of each task per step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--zoo-field", action="append", default=[], metavar="NAME=VALUE", help="a zoo variant (ZooConfig field)"
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = (ZooConfig.tiny(args.zoo_seed) if args.tiny else ZooConfig.mini8(args.zoo_seed)).with_assignments(
        args.zoo_field
    )
    zoo = build_zoo(config)
    clip, tokenizer, processor = load_base_clip(zoo / "base")
    table = load_task_file(zoo / "tasks.json")
    names = list(table.tasks)
    train = {n: _pixels(processor, table.tasks[n], "train") for n in names}
    test = {n: _pixels(processor, table.tasks[n], "test") for n in names}
    classes = {n: image_classes(table.tasks[n]) for n in names}
    heads = {n: zero_shot_head(clip, tokenizer, classes[n].classnames, classes[n].templates) for n in names}

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(args.zoo_seed)
    vision = copy.deepcopy(clip.vision_model).train()
    projection = clip.visual_projection.requires_grad_(False)
    scale = clip.logit_scale.detach().exp()
    trainable = [p for n, p in vision.named_parameters() if not n.startswith(tuple(config.expert_frozen))]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    schedule = _cosine_lr(optimizer, args.lr, args.steps, warmup=max(args.steps // 10, 1))
    for _ in Progress(range(args.steps), desc="multi-task tower", unit="steps"):
        rows = {n: torch.randint(train[n][1].shape[0], (args.per_task,), generator=generator) for n in names}
        pixels = torch.cat([train[n][0][rows[n]] for n in names])
        emb = image_embeddings(vision, projection, pixels).split(args.per_task)
        loss = sum(F.cross_entropy(scale * e @ heads[n].T, train[n][1][rows[n]]) for n, e in zip(names, emb))
        optimizer.zero_grad(set_to_none=True)
        (loss / len(names)).backward()
        optimizer.step()
        schedule.step()
    vision.eval()
    accs = {n: accuracy(vision, projection, heads[n], *test[n]) for n in names}
    accs["average"] = sum(accs.values()) / len(names)
    info = json.loads((zoo / "zoo.json").read_text())
    result = {
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.machine()},
        "zoo": str(zoo),
        "zoo_version": info["version"],
        "settings": {"steps": args.steps, "per_task": args.per_task, "lr": args.lr},
        "train_seconds": round(time.perf_counter() - started, 1),
        "multitask_accuracy": accs,
        "expert_accuracy": {n: r["expert_accuracy"] for n, r in info["tasks"].items()},
    }
    name = f"multitask_{config.name}_seed{args.zoo_seed}.json"
    output = Path(args.output) if args.output else RESULTS / name
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1) + "\n")
    print("| tower | " + " | ".join(names) + " | average |")
    print("|---|" + "---:|" * (len(names) + 1))
    print("| multi-task | " + " | ".join(f"{100 * accs[n]:.1f}" for n in [*names, "average"]) + " |")


if __name__ == "__main__":
    main()
