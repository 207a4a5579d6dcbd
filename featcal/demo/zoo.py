"""Build and cache a benchmark zoo: datasets, a base CLIP and one expert per task, in Hub layout.

The zoo is a folder in exactly the formats of a real run, so featcal's normal loading code reads it::

    <zoo>/base/                  CLIPModel + CLIPProcessor (tokenizer, image processor)
    <zoo>/experts/<task>/        CLIPVisionModel (safetensors)
    <zoo>/data/<task>/data/{train,test}-00000-of-00001.parquet   (image, label with class names)
    <zoo>/tasks.json             the task table (relative paths), usable with --tasks-file
    <zoo>/zoo.json               version, seed, sizes, build time, accuracies measured while building

It is built in a temporary folder beside its final place and renamed into place at the end, so an
interrupted build never leaves a half zoo behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from featcal.demo.cache import build_environment, build_trained_zoo, marked_complete, write_marker, zoo_path
from featcal.demo.config import IMAGE_DRAW, ZOO_VERSION, ZooConfig
from featcal.demo.images import MINI8_TASKS, ImageTask
from featcal.demo.looks import in_task_look
from featcal.demo.styles import restyle
from featcal.demo.tokenizer import build_tokenizer
from featcal.demo.training import TaskTensors, accuracy, finetune_expert, pretrain_clip, zero_shot_head
from featcal.demo.vocabulary import pretraining_classnames
from featcal.progress import Progress


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished zoo of the current version."""
    return marked_complete(folder, "version", ZOO_VERSION)


def build_zoo(
    config: ZooConfig | None = None, cache_dir: str | Path | None = None, force: bool = False, *, progress: bool = True
) -> Path:
    """The folder of the zoo for ``config`` (default :meth:`ZooConfig.mini8`), building it if needed.

    A finished zoo in the cache is returned as is unless ``force``. The build trains on one torch thread
    (:func:`~featcal.demo.cache.build_trained_zoo`), so it is deterministic for a given config, seed and CPU.
    """
    config = config or ZooConfig.mini8()
    return build_trained_zoo(
        zoo_path(config, cache_dir),
        lambda folder: _build_into(folder, config, progress=progress),
        is_complete,
        force=force,
    )


# ---------------------------------------------------------------- the build


def _select_tasks(names: Sequence[str]) -> list[ImageTask]:
    by_name = {t.name: t for t in MINI8_TASKS}
    return [by_name[n] for n in names]


def _draw_split(task: ImageTask, index: int, split: int, count: int, config: ZooConfig):
    """``count`` images of one split with balanced labels, from a seed fixed by (seed, task, split)."""
    rng = np.random.default_rng([config.seed, IMAGE_DRAW, index, split])
    labels = rng.permutation(np.arange(count) % len(task.classnames))
    images = [task.sample(rng, int(label), config.image_size) for label in labels]
    return [in_task_look(image, task.name, config.task_looks) for image in images], labels.tolist()


def _write_parquet(folder: Path, split: str, images: list, labels: list[int], classnames: Sequence[str]) -> None:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classnames))})
    ds = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    folder.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))


def _image_processor(config: ZooConfig):
    from transformers import CLIPImageProcessor

    size = config.image_size
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def _clip_config(config: ZooConfig, tokenizer):
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": config.text_hidden,
            "intermediate_size": 4 * config.text_hidden,
            "num_hidden_layers": config.text_layers,
            "num_attention_heads": config.text_heads,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": config.vision_hidden,
            "intermediate_size": 4 * config.vision_hidden,
            "num_hidden_layers": config.vision_layers,
            "num_attention_heads": config.vision_heads,
            "image_size": config.image_size,
            "patch_size": config.patch_size,
        },
        projection_dim=config.projection_dim,
    )


def _build_into(folder: Path, config: ZooConfig, *, progress: bool) -> None:
    from transformers import CLIPModel, CLIPProcessor, CLIPVisionModel

    started = time.time()
    tasks = _select_tasks(config.tasks)
    processor = _image_processor(config)
    tensors: dict[str, TaskTensors] = {}
    pretraining: dict[str, TaskTensors] = {}  # the train images in the pretraining style
    for index, task in enumerate(
        Progress(tasks, desc=f"{config.name}: drawing datasets", unit="tasks", enabled=progress)
    ):
        splits = []
        for split_index, (split, count) in enumerate(
            (("train", config.train_per_task), ("test", config.test_per_task))
        ):
            images, labels = _draw_split(task, index, split_index, count, config)
            _write_parquet(folder / "data" / task.name / "data", split, images, labels, task.classnames)
            splits += [processor(images=images, return_tensors="pt")["pixel_values"], torch.tensor(labels)]
            if split == "train":
                styled = (
                    splits[0]
                    if config.pretrain_style == "native"
                    else processor(images=restyle(images, config.pretrain_style), return_tensors="pt")["pixel_values"]
                )
        tensors[task.name] = TaskTensors(*splits, classnames=task.classnames, templates=task.templates)
        pretraining[task.name] = replace(
            tensors[task.name],
            train_pixels=styled,
            classnames=pretraining_classnames(task.name, task.classnames, config.pretrain_vocabulary),
        )

    # the benchmark's prompts and the pretraining captions: every word of either is one token chain
    corpus = [
        template.format(name)
        for data in (*tensors.values(), *pretraining.values())
        for template in data.templates
        for name in data.classnames
    ]
    tokenizer = build_tokenizer(corpus)
    torch.manual_seed(config.seed)
    clip = CLIPModel(_clip_config(config, tokenizer))
    pretrain_clip(
        clip,
        tokenizer,
        pretraining,
        steps=config.pretrain_steps,
        batch_size=config.pretrain_batch_size,
        lr=config.pretrain_lr,
        seed=config.seed,
        progress=progress,
    )
    clip.save_pretrained(folder / "base")
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(folder / "base")

    results: dict[str, dict[str, float | int]] = {}
    projection = clip.visual_projection
    for index, task in enumerate(
        Progress(tasks, desc=f"{config.name}: fine-tuning experts", unit="tasks", enabled=progress)
    ):
        data = tensors[task.name]
        head = zero_shot_head(clip, tokenizer, task.classnames, task.templates)
        state = finetune_expert(
            clip,
            head,
            data,
            steps=config.expert_steps,
            batch_size=config.expert_batch_size,
            lr=config.expert_lr,
            seed=config.seed * 1000 + index,
            frozen=config.expert_frozen,
            desc=task.name,
            progress=progress,
        )
        expert = CLIPVisionModel(clip.config.vision_config)
        expert.load_state_dict(state)
        expert.save_pretrained(folder / "experts" / task.name)
        results[task.name] = {
            "classes": len(task.classnames),
            "train": config.train_per_task,
            "test": config.test_per_task,
            "zero_shot_accuracy": accuracy(clip.vision_model, projection, head, data.test_pixels, data.test_labels),
            "expert_accuracy": accuracy(expert, projection, head, data.test_pixels, data.test_labels),
        }
    _write_tables(folder, config, tasks, results, build_seconds=time.time() - started)


def _write_tables(
    folder: Path,
    config: ZooConfig,
    tasks: Sequence[ImageTask],
    results: dict[str, dict[str, float | int]],
    *,
    build_seconds: float,
) -> None:
    table = {
        "about": f"The {config.name} benchmark zoo (featcal, version {ZOO_VERSION}, seed {config.seed}): "
        "procedural image tasks, a small CLIP pretrained on their captions with the images in the "
        f"{config.pretrain_style!r} style, one expert per task; task looks {config.task_looks!r}. "
        "Paths are relative to this file. reference_accuracy holds the accuracies measured while "
        "building (fractions of the test split).",
        "base_model": "base",
        "tasks": {
            task.name: {
                "dataset": {
                    "path": f"data/{task.name}",
                    "name": None,
                    "train_split": "train",
                    "test_split": "test",
                    "image_column": "image",
                    "label_column": "label",
                },
                "expert": f"experts/{task.name}",
                "classnames": list(task.classnames),
                "templates": list(task.templates),
                "reference_accuracy": {
                    "zero_shot": results[task.name]["zero_shot_accuracy"],
                    "expert": results[task.name]["expert_accuracy"],
                },
            }
            for task in tasks
        },
    }
    (folder / "tasks.json").write_text(json.dumps(table, indent=1) + "\n")
    mean = {
        key: float(np.mean([r[key] for r in results.values()])) for key in ("zero_shot_accuracy", "expert_accuracy")
    }
    info = {
        "name": config.name,
        "version": ZOO_VERSION,
        "seed": config.seed,
        "config": config.to_dict(),
        **build_environment(build_seconds),
        "descriptions": {task.name: task.caption for task in tasks},
        "tasks": results,
        "average": mean,
    }
    write_marker(folder, info)
