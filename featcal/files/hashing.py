"""Hashes that name files and recipes: a file's SHA-256 (as the Hub lists it), a mapping's stable hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CHUNK = 1 << 20  # bytes read at a time when hashing a file


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex (what the Hub lists for a file stored in LFS).

    Args:
        path: The file.

    Returns:
        64 hex digits.
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def config_hash(data: Mapping[str, Any]) -> str:
    """A stable SHA-256 of a JSON-able mapping (sorted keys), naming a recipe."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
