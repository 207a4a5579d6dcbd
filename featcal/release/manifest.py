"""What `featcal export` records about a release, so that push can tell it is still what export wrote.

Two records, both written at export:

* in the safetensors header of ``model.safetensors`` (metadata, next to ``featcal_version`` and
  ``recipe_sha256``): ``tensors_sha256``, a SHA-256 of the tensor data (:func:`tensors_sha256`), and
  ``published_config_sha256``, the recipe hash of the published ``run_config.json``;
* ``release_manifest.json``: the SHA-256 of every other file of the release, by name, with the
  recipe hash and ``tensors_sha256`` of the weights it goes with. `featcal card` rewrites the
  entries of the card and its plot when it regenerates them; any other change to a file is refused.

These guard against a release changed by accident after export (an edit by hand, a file copied in
from elsewhere, a corrupted download), not against someone who rewrites the records on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.errors import ReleaseError
from featcal.files.atomic import atomic_write_json
from featcal.files.hashing import file_sha256
from featcal.release.tensors import tensors_sha256_of

MANIFEST = "release_manifest.json"
MANIFEST_FORMAT = "featcal-release-manifest/1"


def tensors_sha256(path: Path) -> str:
    """The SHA-256 of the tensor data of a safetensors file, independent of its header's layout.

    For each tensor in the order of its name: the line ``["<name>","<dtype>",[<shape>]]`` (compact
    JSON, then ``\\n``) and the tensor's raw bytes as stored (little-endian). The metadata, the order
    of the tensors in the file and the header's padding do not enter it, so stamping metadata into the
    header leaves it unchanged, while any change of a tensor's value, dtype, shape or name changes it.

    Args:
        path: A safetensors file.

    Returns:
        64 hex digits.

    Raises:
        ReleaseError: when the file is not a readable safetensors file.
    """
    return tensors_sha256_of([path])


@dataclass(frozen=True)
class Manifest:
    """``release_manifest.json``: the SHA-256 of each file of a release, as export (or `featcal card`) wrote it,
    and where its weights came from: the run's stage and the SHA-256 of each of its weight files, as the
    run's ledger recorded them (``source``; empty for a release of a run that recorded none)."""

    recipe_sha256: str
    tensors_sha256: str
    files: Mapping[str, str]
    source: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The manifest as written to disk (keys sorted, so a re-export gives the same bytes)."""
        data = {
            "format": MANIFEST_FORMAT,
            "recipe_sha256": self.recipe_sha256,
            "tensors_sha256": self.tensors_sha256,
            "files": dict(sorted(self.files.items())),
        }
        if self.source:
            data["source"] = dict(self.source)
        return data


def manifest_of(
    folder: Path, names: Iterable[str], *, recipe: str, tensors: str, source: Mapping[str, Any] | None = None
) -> Manifest:
    """The manifest of the files ``names`` of ``folder`` as they are now.

    Args:
        folder: The release folder.
        names: The files to record (all files of the release but the manifest itself).
        recipe: The run's recipe hash (``recipe_sha256`` of the weights).
        tensors: The weights' ``tensors_sha256``.
        source: The run's stage the weights came from and the ledger's SHA-256 of its weight files.

    Returns:
        The manifest (not written).
    """
    return Manifest(recipe, tensors, {name: file_sha256(folder / name) for name in sorted(names)}, source or {})


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write ``release_manifest.json`` into ``folder`` (atomically) and return its path."""
    path = folder / MANIFEST
    atomic_write_json(path, manifest.to_json())
    return path


def read_manifest(folder: Path) -> Manifest:
    """The manifest of the release in ``folder``.

    Args:
        folder: The release folder.

    Returns:
        The manifest.

    Raises:
        ReleaseError: when the manifest is missing, not JSON, or not a featcal release manifest.
    """
    path = folder / MANIFEST
    fix = "rebuild the release with `featcal export RUN_FOLDER`"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReleaseError(path, f"{folder} is not a complete release: {MANIFEST} missing; {fix}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReleaseError(path, f"{path} is not valid JSON ({exc}); {fix}.") from None
    files = data.get("files") if isinstance(data, dict) else None
    valid = (
        isinstance(data, dict)
        and data.get("format") == MANIFEST_FORMAT
        and isinstance(data.get("recipe_sha256"), str)
        and isinstance(data.get("tensors_sha256"), str)
        and isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    )
    if not valid:
        raise ReleaseError(path, f"{path} is not a featcal release manifest ({MANIFEST_FORMAT}); {fix}.")
    source = data.get("source") if isinstance(data.get("source"), dict) else {}
    return Manifest(data["recipe_sha256"], data["tensors_sha256"], dict(files), source)


def update_manifest(folder: Path, written: Mapping[str, bool]) -> Path | None:
    """Record in ``folder``'s manifest the files just rewritten (True) or removed (False), if it has one.

    `featcal card` calls this after it regenerates the card and its plot in a release folder, so that
    the regenerated files are accepted by :func:`~featcal.release.check.check_release`; entries of
    other files are kept as they are.

    Args:
        folder: The release folder.
        written: Each file rewritten (True) or deleted (False).

    Returns:
        The manifest's path, or None when ``folder`` has no manifest (it is not a release folder).

    Raises:
        ReleaseError: when the existing manifest cannot be read.
    """
    if not (folder / MANIFEST).is_file():
        return None
    manifest = read_manifest(folder)
    files = dict(manifest.files)
    for name, present in written.items():
        if present:
            files[name] = file_sha256(folder / name)
        else:
            files.pop(name, None)
    return write_manifest(folder, Manifest(manifest.recipe_sha256, manifest.tensors_sha256, files, manifest.source))
