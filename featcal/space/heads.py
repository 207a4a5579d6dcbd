"""Class embeddings of every task, computed once and kept on disk for the next start.

The eight TA8 tasks have 3,727 prompts: a few minutes of CLIP text tower on a small CPU. Each
task's head is stored as safetensors under a key made of the base model's files (path, size,
modification time) and the task's class names and templates, so any change recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.evaluation import ZeroShotClassifier
from featcal.progress import Progress
from featcal.tasks import Task

logger = logging.getLogger(__name__)

HEAD_KEY = "head"


def default_cache_dir() -> Path:
    """``$FEATCAL_CACHE`` or ``$XDG_CACHE_HOME/featcal`` (``~/.cache/featcal``), then ``space-heads``."""
    root = (
        os.environ.get("FEATCAL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "featcal"
    )
    return Path(root) / "space-heads"


def base_fingerprint(folder: Path) -> list:
    """What identifies a base model folder's text side: its files' resolved paths, sizes and times."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in {".json", ".safetensors", ".txt"})
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _key(fingerprint: list, task: Task) -> str:
    data = {"base": fingerprint, **image_classes(task).to_dict()}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def task_heads(
    classifier: ZeroShotClassifier,
    tasks: Iterable[Task],
    base_folder: Path,
    cache_dir: Path | None,
    *,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Per task, its [classes, dim] head: read from ``cache_dir`` when stored, else computed (and stored)."""
    fingerprint = base_fingerprint(base_folder)
    heads: dict[str, torch.Tensor] = {}
    for task in Progress(list(tasks), desc="Class embeddings", unit="tasks", enabled=progress):
        path = cache_dir / f"{task.name}-{_key(fingerprint, task)}.safetensors" if cache_dir else None
        if path is not None and path.is_file():
            try:
                heads[task.name] = load_file(str(path))[HEAD_KEY].to(classifier.device)
                continue
            except (OSError, KeyError, SafetensorError) as exc:
                logger.warning("Ignoring the unreadable cached head %s (%s)", path, exc)
        heads[task.name] = classifier.head(task)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                save_file({HEAD_KEY: heads[task.name].detach().cpu().contiguous()}, str(tmp))
                os.replace(tmp, path)
            except OSError as exc:
                logger.warning("Cannot cache the class embeddings of %s in %s (%s)", task.name, cache_dir, exc)
    return heads
