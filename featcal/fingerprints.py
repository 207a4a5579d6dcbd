"""Identities of a run's inputs, so a re-run can tell which stages are still up to date.

A model folder is identified by its files' names, sizes, modification times and resolved paths (a
Hub snapshot's files resolve to content-addressed blobs, so a new revision is a new identity); a
dataset split by the fingerprint ``datasets`` gives it (derived from its files, or the Hub
revision). Reading every byte of a multi-GB checkpoint on each run would cost more than the
stages it saves, so an edit that keeps a file's size and modification time is not noticed: use
``--force`` after such an edit.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MODEL_FILES = (".json", ".safetensors", ".txt", ".model")


def digest(*parts: Any) -> str:
    """A SHA-256 of JSON-able parts (sorted keys), as hex."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def folder_fingerprint(folder: str | Path, suffixes: Iterable[str] = MODEL_FILES) -> str:
    """The identity of a model folder (or a single file): each file's name, size, mtime and real path."""
    folder = Path(folder)
    files = [folder] if folder.is_file() else sorted(p for p in folder.iterdir() if p.suffix in tuple(suffixes))
    entries = []
    for path in files:
        stat = path.stat()
        entries.append((path.name, os.path.realpath(path), stat.st_size, stat.st_mtime_ns))
    return digest(entries)


def dataset_fingerprint(dataset: Any) -> str:
    """The identity ``datasets`` gives a loaded split (falls back to its files' identities)."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint:
        return str(fingerprint)
    files = [f.get("filename") for f in getattr(dataset, "cache_files", [])]
    return digest([folder_fingerprint(f, suffixes=()) for f in files if f])
