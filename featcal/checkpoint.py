"""Memory-mapped, read-only access to the vision-tower tensors of a safetensors checkpoint.

A :class:`Checkpoint` reads one tensor at a time, so merging methods and the calibration engine can
stream experts without ever holding a whole model in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from featcal.errors import FeatcalError

VISION_PREFIX = "vision_model."
_INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a `save_pretrained` folder (single file or sharded)."""
    index = folder / _INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / _SINGLE_NAME
    if single.is_file():
        return [single]
    if folder.is_file() and folder.suffix == ".safetensors":
        return [folder]
    pickles = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
    hint = (
        f" It has only pickle weights ({', '.join(pickles)}); featcal never loads pickles: convert "
        "them with `model.save_pretrained(folder)` in transformers, which writes safetensors."
        if pickles
        else ""
    )
    raise FeatcalError(f"No safetensors weights in {folder}.{hint}")


class Checkpoint(Mapping[str, torch.Tensor]):
    """The vision-tower tensors of a checkpoint, keyed without the ``vision_model.`` prefix.

    Accepts a `CLIPModel` or `CLIPVisionModel` folder, or a bare ``.safetensors`` file. Tensors are
    read lazily from memory-mapped files; nothing is cached, so each ``ckpt[key]`` reads again.
    """

    def __init__(self, path: str | Path, *, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or str(path)
        self._handles = [safe_open(str(f), framework="pt") for f in _weight_files(self.path)]
        raw: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for key in handle.keys():
                raw[key] = i
        has_prefix = any(k.startswith(VISION_PREFIX) for k in raw)
        self._where: dict[str, tuple[int, str]] = {}
        for key, i in raw.items():
            if has_prefix:
                if key.startswith(VISION_PREFIX):
                    self._where[key[len(VISION_PREFIX) :]] = (i, key)
            else:
                self._where[key] = (i, key)
        if not self._where:
            raise FeatcalError(f"{self.name}: the checkpoint holds no tensors.")

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i, raw_key = self._where[key]
        except KeyError:
            raise KeyError(f"{self.name} has no tensor {key!r}") from None
        return self._handles[i].get_tensor(raw_key)

    def shape(self, key: str) -> tuple[int, ...]:
        i, raw_key = self._where[key]
        return tuple(self._handles[i].get_slice(raw_key).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"Checkpoint({self.name!r}, {len(self)} tensors)"


def check_compatible(base: Checkpoint, experts: Mapping[str, Checkpoint]) -> None:
    """Raise a :class:`FeatcalError` naming the expert whose keys or shapes differ from the base."""
    base_keys = set(base)
    for task, expert in experts.items():
        keys = set(expert)
        if keys != base_keys:
            missing = sorted(base_keys - keys)[:3]
            extra = sorted(keys - base_keys)[:3]
            raise FeatcalError(
                f"Expert for task {task!r} ({expert.name}) does not match the base model's vision "
                f"tower: missing {missing}, unexpected {extra}. Experts must be fine-tuned from the "
                "base model (same architecture and parameter names)."
            )
        for key in base_keys:
            if expert.shape(key) != base.shape(key):
                raise FeatcalError(
                    f"Expert for task {task!r} ({expert.name}): tensor {key!r} has shape "
                    f"{expert.shape(key)}, the base model has {base.shape(key)}. Experts must share "
                    "the base model's architecture."
                )
