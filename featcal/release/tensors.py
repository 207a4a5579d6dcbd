"""Safetensors files read without loading them: their headers, checked, and a hash of their tensor data.

A release is checked before a push and identified in its manifest without loading its model: an 8B
language model's weights are 16 GB. Only the header of each file (a JSON table of every tensor's dtype,
shape and byte range) is parsed, and the tensor bytes are streamed through a hash.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.errors import ReleaseError
from featcal.files.hashing import CHUNK

METADATA = "__metadata__"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on a header


@dataclass(frozen=True)
class SafetensorsHeader:
    """The header of a safetensors file.

    Attributes:
        path: The file.
        tensors: Each tensor's entry (``dtype``, ``shape``, ``data_offsets``), by name.
        metadata: The header's ``__metadata__`` (empty when absent).
        data_start: Where the tensor data begins in the file (8 bytes of length, then the header).
    """

    path: Path
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path) -> SafetensorsHeader:
    """The header of a safetensors file, checked: every tensor's bytes lie in the file.

    Args:
        path: A safetensors file.

    Returns:
        The header.

    Raises:
        ReleaseError: when the file is missing or not a readable safetensors file (a header that is not
            JSON, a tensor entry without dtype, shape or offsets, or offsets beyond the end of the file).
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        data_start = 8 + length
        tensors = {}
        for name, entry in header.items():
            if name == METADATA:
                continue
            begin, end = entry["data_offsets"]
            if not (isinstance(entry["dtype"], str) and isinstance(entry["shape"], list)):
                raise ValueError(f"tensor {name} has no dtype or shape")
            if not 0 <= begin <= end or data_start + end > size:
                raise ValueError(f"tensor {name} runs past the end of the file")
            tensors[name] = entry
        metadata = header.get(METADATA) or {}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ReleaseError(path, f"{path} is not a readable safetensors file ({exc}).") from None
    return SafetensorsHeader(path, tensors, dict(metadata), data_start)


def tensors_sha256_of(paths: Sequence[Path]) -> str:
    """The SHA-256 of the tensor data of one or more safetensors files (a model's shards), independent of
    how the tensors are split into files and of each header's layout.

    For each tensor of all the files in the order of its name: the line ``["<name>","<dtype>",[<shape>]]``
    (compact JSON, then ``\\n``) and the tensor's raw bytes as stored (little-endian). The metadata, the
    order of the tensors in a file, the header's padding and which file holds a tensor do not enter it;
    any change of a tensor's value, dtype, shape or name changes it. For one file it is
    :func:`featcal.release.manifest.tensors_sha256` of that file.

    Args:
        paths: The safetensors files.

    Returns:
        64 hex digits.

    Raises:
        ReleaseError: when a file is not a readable safetensors file, or two files hold a tensor of the
            same name.
    """
    owner: dict[str, SafetensorsHeader] = {}
    for path in paths:
        header = read_header(path)
        for name in header.tensors:
            if name in owner:
                raise ReleaseError(path, f"{path} and {owner[name].path} both hold the tensor {name}.")
            owner[name] = header
    digest = hashlib.sha256()
    handles: dict[Path, Any] = {}
    try:
        for name in sorted(owner):
            header = owner[name]
            entry = header.tensors[name]
            line = json.dumps([name, entry["dtype"], entry["shape"]], separators=(",", ":"))
            digest.update(line.encode() + b"\n")
            f = handles.get(header.path) or handles.setdefault(header.path, header.path.open("rb"))
            begin, end = entry["data_offsets"]
            f.seek(header.data_start + begin)
            remaining = end - begin
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    raise ReleaseError(header.path, f"{header.path}: tensor {name} runs past the end of the file.")
                digest.update(chunk)
                remaining -= len(chunk)
    except OSError as exc:
        raise ReleaseError(None, f"The weights could not be read ({exc}).") from None
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()
