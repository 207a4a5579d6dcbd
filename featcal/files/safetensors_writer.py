"""A safetensors file written tensor by tensor, in any order, without the whole state in memory.

The header (every tensor's name, dtype, shape and place) is written first, from a layout known in
advance; each tensor's bytes then go straight to their place in the file. The result is what
``safetensors.torch.save_file`` writes for the same tensors, up to the order of the header's keys
and of the tensors' bytes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

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


def _write_at(fd: int, data: bytes | memoryview | np.ndarray, position: int) -> None:
    """All of ``data`` (bytes-like) into ``fd`` at ``position``, however many writes it takes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written
