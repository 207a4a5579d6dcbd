"""Memory-mapped, read-only access to the tensors of a safetensors checkpoint.

A :class:`Checkpoint` reads one tensor at a time, so merging methods and the calibration engine can
stream experts without ever holding a whole model in memory. A model family names the part of a
checkpoint it merges by a key prefix (CLIP's vision tower is ``vision_model.`` in a ``CLIPModel``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from featcal.errors import FeatcalError, ModelInputError
from featcal.files.model_files import WEIGHTS, WEIGHTS_INDEX

StateDict = Mapping[str, torch.Tensor]  # a dict of tensors, or a Checkpoint read lazily


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a `save_pretrained` folder (single file or sharded)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelInputError(
                str(folder), f"{index} is not a readable shard index (no weight_map): save the model again."
            ) from None
        files = [folder / str(name) for name in names]
        unusable = [f.name for f in files if f.suffix != ".safetensors" or not f.is_file()]
        if unusable:
            raise ModelInputError(
                str(folder),
                f"{index} names shards that are missing or not safetensors ({', '.join(unusable[:3])}); featcal "
                "reads safetensors only and never loads pickles: save the model again with `save_pretrained`.",
            )
        return files
    single = folder / WEIGHTS
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
    """The tensors of a checkpoint (those under ``prefix``, keyed without it, when it has any).

    Accepts a ``save_pretrained`` folder (one weights file or shards with an index), or a bare
    ``.safetensors`` file. With ``prefix`` (CLIP's ``"vision_model."``) a checkpoint that has keys
    under it is read as that part alone (a ``CLIPModel``'s vision tower), and one that has none as it
    is (a ``CLIPVisionModel``). Tensors are
    read lazily, one at a time; nothing is cached. A file is open (memory-mapped) only while it is
    read: by one ``ckpt[key]``, or for the whole of a ``with ckpt.reading():`` block. Pages a
    long-lived mapping has touched count in the process's RSS, so a checkpoint kept for a whole run
    would hold every tensor it ever read (3 GB for a base and eight ViT-B/32 experts).
    """

    def __init__(self, path: str | Path, *, name: str | None = None, prefix: str = "", part: str = "tensors") -> None:
        self.path = Path(path)
        self.part = part  # what the tensors are, for messages ("vision tower")
        self.name = name or str(path)
        self.files = _weight_files(self.path)
        raw: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for i, file in enumerate(self.files):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():
                        raw[key] = i
                        shapes[key] = tuple(handle.get_slice(key).get_shape())
            except (SafetensorError, OSError) as exc:
                raise ModelInputError(
                    str(file),
                    f"{self.name}: {file} is not a readable safetensors file ({exc}); it may be truncated or "
                    "damaged: download or save it again.",
                ) from None
        has_prefix = bool(prefix) and any(k.startswith(prefix) for k in raw)
        self._where: dict[str, tuple[int, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for key, i in raw.items():
            if has_prefix and not key.startswith(prefix):
                continue
            name = key[len(prefix) :] if has_prefix else key
            self._where[name] = (i, key)
            self._shapes[name] = shapes[key]
        if not self._where:
            raise FeatcalError(f"{self.name}: the checkpoint holds no tensors.")
        self._open: list[Any] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i, raw_key = self._where[key]
        except KeyError:
            raise KeyError(f"{self.name} has no tensor {key!r}") from None
        if self._open is not None:
            return self._open[i].get_tensor(raw_key)
        with safe_open(str(self.files[i]), framework="pt") as handle:
            return handle.get_tensor(raw_key)

    @contextmanager
    def reading(self) -> Iterator[Checkpoint]:
        """Keep the files open for many reads (one mapping per file); closed, and unmapped, after."""
        with ExitStack() as stack:
            self._open = [stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
            try:
                yield self
            finally:
                self._open = None

    def alias(self, key: str, existing: str) -> None:
        """Read ``existing``'s tensor under the name ``key`` too (a head tied to the embedding, stored once).

        Args:
            key: The second name, which the checkpoint does not hold.
            existing: The name the tensor is stored under.
        """
        self._where[key] = self._where[existing]
        self._shapes[key] = self._shapes[existing]

    def drop(self, key: str) -> None:
        """Leave ``key`` out of the checkpoint (a stored copy of a tied tensor, read under its other name)."""
        del self._where[key], self._shapes[key]

    def file_of(self, key: str) -> Path:
        """The safetensors file that holds ``key``."""
        return self.files[self._where[key][0]]

    def check_finite(self) -> None:
        """Raise naming the file and tensor of the first NaN or infinite value, reading one tensor at a time.

        Raises:
            ModelInputError: when a floating-point tensor holds a NaN or an infinity.
        """
        with self.reading():
            bad = next((key for key in self if not _finite(self[key])), None)
        if bad is not None:
            raise ModelInputError(
                self.name,
                f"{self.name}: tensor {bad!r} in {self.file_of(bad)} is not finite (NaN or infinity); "
                "replace the checkpoint with a healthy one.",
            )

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key``, read from the header when the checkpoint was opened."""
        return self._shapes[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"Checkpoint({self.name!r}, {len(self)} tensors)"


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def check_same_architecture(base: Checkpoint, shapes: Mapping[str, tuple[int, ...]], what: str, ref: str) -> None:
    """Raise naming ``what`` when its tensor names or shapes differ from the base's.

    Args:
        base: The base model's tensors (the part its family merges).
        shapes: The other model's tensor shapes by name (as the base's are keyed).
        what: How to name the other model, e.g. ``"Expert for task 'mnist' (…)"``.
        ref: The other model's path or id, carried by the error.

    Raises:
        ModelInputError: for a missing or unexpected tensor, or a shape that differs.
    """
    base_keys, keys = set(base), set(shapes)
    if keys != base_keys:
        missing = sorted(base_keys - keys)[:3]
        extra = sorted(keys - base_keys)[:3]
        raise ModelInputError(
            ref,
            f"{what} does not match the base model's {base.part}: missing {missing}, unexpected {extra}. "
            "It must be fine-tuned or merged from the base model (same architecture and parameter names).",
        )
    for key in sorted(base_keys):
        if tuple(shapes[key]) != base.shape(key):
            raise ModelInputError(
                ref,
                f"{what}: tensor {key!r} has shape {tuple(shapes[key])}, the base model has {base.shape(key)}. "
                "It must share the base model's architecture.",
            )


def check_compatible(base: Checkpoint, experts: Mapping[str, Checkpoint]) -> None:
    """Raise a :class:`ModelInputError` naming the expert whose keys or shapes differ from the base."""
    for expert in experts.values():
        shapes = {key: expert.shape(key) for key in expert}
        check_same_architecture(base, shapes, expert.name, str(expert.path))


def read_tied_once(checkpoint: Checkpoint, aliases: Mapping[str, str]) -> None:
    """Leave out each stored copy of a tied tensor that holds the tensor's own values, as transformers ties them
    on load (a tied model saved with its ``lm_head.weight`` too).

    Args:
        checkpoint: The folder's tensors.
        aliases: Each tied tensor's second name and the name ``save_pretrained`` keeps
            (:attr:`featcal.files.model_folders.SavedLayout.aliases` of the folder's model).

    Raises:
        ModelInputError: naming the copy, when it holds other values: the configuration ties what the
            weights keep apart.
    """
    for alias, kept in aliases.items():
        if alias not in checkpoint or kept not in checkpoint:
            continue
        with checkpoint.reading():
            same = torch.equal(checkpoint[alias], checkpoint[kept])
        if not same:
            raise ModelInputError(
                str(checkpoint.path),
                f"{checkpoint.name}: its configuration ties {alias!r} to {kept!r} (tie_word_embeddings), but it stores "
                f"{alias!r} with other values: set tie_word_embeddings to false in its config.json if the head is its "
                "own, or save the model again with save_pretrained.",
            )
        checkpoint.drop(alias)


def check_finite_state(state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise naming the first non-finite tensor of a result computed from finite inputs (a merge, a calibration).

    Raises:
        FeatcalError: naming ``what`` and the tensor.
    """
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FeatcalError(f"{what}: tensor {key!r} is not finite, although every input is.")


@contextmanager
def reading_state(source: StateDict) -> Iterator[StateDict]:
    """``source`` for a block of reads: a :class:`Checkpoint`'s files stay mapped for the block and
    are unmapped after, so memory stays flat in the number of experts."""
    if isinstance(source, Checkpoint):
        with source.reading():
            yield source
    else:
        yield source


def load_params(module: nn.Module, source: StateDict, prefix: str) -> None:
    """Copy ``source[prefix + name]`` into each parameter and buffer of ``module`` (strict).

    A tensor the module holds under two names (an LM head tied to the token embedding) is read under
    the one the checkpoint has: ``save_pretrained`` writes a tied tensor once.
    """
    state = module.state_dict(keep_vars=True)
    with reading_state(source) as tensors:
        with torch.no_grad():
            for name, current in state.items():
                key = prefix + name
                if key not in tensors:
                    if any(other is current and prefix + alias in tensors for alias, other in state.items()):
                        continue  # tied: filled under its other name
                    raise FeatcalError(f"Checkpoint has no tensor {key!r} needed for calibration.")
                current.copy_(tensors[key])
