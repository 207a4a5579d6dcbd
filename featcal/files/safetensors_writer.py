"""Safetensors files written tensor by tensor, in any order, without the whole state in memory.

The header (every tensor's name, dtype, shape and place) is written first, from a layout known in
advance; each tensor's bytes then go straight to their place in the file. The result is what
``safetensors.torch.save_file`` writes for the same tensors, up to the order of the header's keys
and of the tensors' bytes. :class:`ShardedSafetensorsWriter` writes the files of one model folder (one
file, or the shards of an index) through one ``write(name, tensor)``, which sends each tensor to its
file, and stores once a tensor known under two names (tied weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


class TensorWriter(Protocol):
    """What takes a model's tensors by name: a :class:`SafetensorsWriter`, a :class:`ShardedSafetensorsWriter`."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` as ``name``."""


class SafetensorsWriter:
    """Writes the tensors of ``layout`` (name → dtype, shape) into a new safetensors file at ``path``.

    Args:
        path: The file to create (replaced if it exists).
        layout: Every tensor the file will hold.
        metadata: The header's ``__metadata__`` (``{"format": "pt"}`` for transformers).

    Raises:
        ValueError: for a dtype safetensors has no name for.
        RuntimeError: on a big-endian machine (the bytes would not be safetensors').
        OSError: when the file cannot be created.
    """

    def __init__(self, path: str | Path, layout: Layout, metadata: Mapping[str, str] | None = None) -> None:
        if sys.byteorder != "little":  # safetensors stores little-endian bytes
            raise RuntimeError("SafetensorsWriter writes a little-endian machine's tensors as they are")
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._places: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name in sorted(layout):
            dtype, shape = layout[name]
            if dtype not in _DTYPES:
                raise ValueError(f"safetensors has no dtype for {dtype} (tensor {name!r})")
            size = dtype.itemsize
            for dim in shape:
                size *= dim
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._places[name] = (offset, dtype, tuple(shape))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._data_start = 8 + len(text)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _write_at(self._fd, len(text).to_bytes(8, "little") + text, 0)
            os.ftruncate(self._fd, self._data_start + offset)
        except BaseException:
            os.close(self._fd)
            raise
        self._pending = set(self._places)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (cast to the layout's dtype) at the place of ``name``.

        Raises:
            KeyError: for a name the layout does not have, or one already written.
            ValueError: for a tensor of another shape than the layout's.
        """
        if self._fd is None or name not in self._pending:
            raise KeyError(f"{name!r} is not a tensor of this file still to write")
        offset, dtype, shape = self._places[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, the file's layout {shape}")
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        _write_at(self._fd, data, self._data_start + offset)
        self._pending.remove(name)

    def pending(self) -> list[str]:
        """The tensors of the layout not written yet, sorted (none once the file is closed)."""
        return sorted(self._pending) if self._fd is not None else []

    def close(self) -> None:
        """Flush the file to disk and close it.

        Raises:
            ValueError: when some tensor of the layout was never written (the file is closed all the same).
        """
        if self._fd is None:
            return
        try:
            if self._pending:
                missing = sorted(self._pending)
                raise ValueError(f"{len(missing)} tensor(s) never written, e.g. {missing[:3]}")
            os.fsync(self._fd)
        finally:
            self.discard()

    def discard(self) -> None:
        """Close the file without checking it is complete (after a failure: the caller removes it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ShardedSafetensorsWriter:
    """The safetensors files of one model folder, written tensor by tensor: ``write`` sends each tensor
    to the file that holds it. One file, or the shards a ``model.safetensors.index.json`` names; the
    index itself is the caller's to write.

    A tensor known under two names (tied weights: a language model's ``lm_head.weight`` is its input
    embedding) is stored once, under one name. A write of the other name, its alias, stores nothing: it
    is accepted when its bytes in the stored dtype are the stored tensor's (compared by digest, in
    whichever order the two come), and refused with a ValueError when they differ. An alias need not be
    written.

    Args:
        folder: The folder the files are created in.
        files: Each file's name and the layout of the tensors it holds (a name in one file only).
        metadata: Every file's header ``__metadata__`` (``{"format": "pt"}`` for transformers).
        aliases: Names not stored because they are another tensor under a second name: alias → the
            name it is stored under.
        ignored: Names whose writes are accepted and dropped (not stored, never required).

    Raises:
        ValueError: for a name in two files or also an alias or ignored, an alias of a name no file
            holds, or a dtype safetensors has no name for.
        OSError: when a file cannot be created (those created are closed).
    """

    def __init__(
        self,
        folder: str | Path,
        files: Mapping[str, Layout],
        metadata: Mapping[str, str] | None = None,
        *,
        aliases: Mapping[str, str] | None = None,
        ignored: Collection[str] = (),
    ) -> None:
        self._file_of: dict[str, int] = {}
        for i, layout in enumerate(files.values()):
            for name in layout:
                if name in self._file_of:
                    raise ValueError(f"{name!r} is laid out in two files")
                self._file_of[name] = i
        self._aliases = dict(aliases or {})
        self._ignored = frozenset(ignored)
        clash = sorted((set(self._aliases) | self._ignored) & set(self._file_of))
        if clash or set(self._aliases) & self._ignored:
            raise ValueError(f"Names both stored and aliased or ignored: {clash[:3]}")
        orphans = sorted(alias for alias, name in self._aliases.items() if name not in self._file_of)
        if orphans:
            raise ValueError(f"Aliases of tensors no file holds: {orphans[:3]}")
        self._layouts = list(files.values())
        self._aliased = frozenset(self._aliases.values())  # the stored names that have an alias
        self._digests: dict[str, bytes] = {}  # of each aliased tensor written, in its stored dtype
        self._alias_digests: dict[str, bytes] = {}  # of each alias written
        self._writers: list[SafetensorsWriter] = []
        try:
            for file, layout in files.items():
                self._writers.append(SafetensorsWriter(Path(folder) / file, layout, metadata))
        except BaseException:
            self.discard()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (cast to the layout's dtype) as ``name``, into the file that holds it.

        Raises:
            KeyError: for a name no file holds and that is neither an alias nor ignored, or one already
                written.
            ValueError: for a tensor of another shape than the layout's, or an alias whose bytes are not
                those of the tensor it names (whichever of the two is written second).
        """
        if name in self._ignored:
            return
        if name in self._aliases:
            self._write_alias(name, tensor)
            return
        if name not in self._file_of:
            raise KeyError(f"{name!r} is not a tensor of these files")
        if name not in self._aliased:
            self._writers[self._file_of[name]].write(name, tensor)
            return
        stored = self._stored(name, tensor)
        self._writers[self._file_of[name]].write(name, stored)
        self._digests[name] = _digest(stored)
        for alias, target in self._aliases.items():
            if target == name and alias in self._alias_digests:
                self._check_alias(alias)

    def _stored(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the file stores ``name``: on the CPU, in its dtype, contiguous.

        Raises:
            ValueError: for another shape than the layout's.
        """
        dtype, shape = self._layouts[self._file_of[name]][name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, the file's layout {tuple(shape)}")
        return tensor.detach().to(device="cpu", dtype=dtype).contiguous()

    def _write_alias(self, alias: str, tensor: torch.Tensor) -> None:
        if alias in self._alias_digests:
            raise KeyError(f"{alias!r} was already written")
        target = self._aliases[alias]
        shape = tuple(self._layouts[self._file_of[target]][target][1])
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{alias!r} is {target!r} under another name (tied weights), of shape {shape}, "
                f"not {tuple(tensor.shape)}"
            )
        self._alias_digests[alias] = _digest(self._stored(target, tensor))
        if target in self._digests:
            self._check_alias(alias)

    def _check_alias(self, alias: str) -> None:
        target = self._aliases[alias]
        if self._alias_digests[alias] != self._digests[target]:
            raise ValueError(
                f"{alias!r} and {target!r} are one tensor in this model (tied weights), stored once as {target!r}, "
                "but were written with different values."
            )

    def pending(self) -> list[str]:
        """The stored tensors not written yet, sorted (aliases and ignored names are never pending)."""
        return sorted(name for writer in self._writers for name in writer.pending())

    def close(self) -> None:
        """Flush every file to disk and close it.

        Raises:
            ValueError: when some tensor was never written (the files are closed all the same).
        """
        try:
            missing = self.pending()
            if missing:
                raise ValueError(f"{len(missing)} tensor(s) never written, e.g. {missing[:3]}")
            for writer in self._writers:
                writer.close()
        finally:
            self.discard()

    def discard(self) -> None:
        """Close every file without checking it is complete (after a failure: the caller removes them)."""
        for writer in self._writers:
            writer.discard()


def _digest(tensor: torch.Tensor) -> bytes:
    """A digest of a contiguous CPU tensor's bytes."""
    return hashlib.blake2b(tensor.reshape(-1).view(torch.uint8).numpy()).digest()


def _write_at(fd: int, data: bytes | memoryview | np.ndarray, position: int) -> None:
    """All of ``data`` (bytes-like) into ``fd`` at ``position``, however many writes it takes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written
