"""What a publisher sends, and a check of what the Hub holds afterwards (sizes and hashes)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.errors import HubError

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

logger = logging.getLogger(__name__)

CHUNK = 1 << 20


@dataclass(frozen=True)
class HubFile:
    """One file to publish: its path in the repository, on disk, and its size in bytes."""

    path_in_repo: str
    local: Path
    size: int

    def sha256(self) -> str:
        """The SHA-256 of the file (what the Hub lists for files stored in LFS)."""
        digest = hashlib.sha256()
        with self.local.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def git_blob_sha1(self) -> str:
        """The git object id of the file (what the Hub lists for files not stored in LFS)."""
        digest = hashlib.sha1(f"blob {self.size}\0".encode())
        with self.local.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()


def local_files(folder: str | Path) -> tuple[HubFile, ...]:
    """Every file under ``folder`` that a push uploads, sorted; hidden files and folders are skipped.

    Args:
        folder: The folder to publish.

    Returns:
        The files, each by its path in the repository (``/``-separated, relative to ``folder``).
    """
    folder = Path(folder)
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append(HubFile(rel.as_posix(), path, path.stat().st_size))
    return tuple(files)


def hub_files(
    api: HfApi, repo_id: str, *, revision: str | None = None, repo_type: str | None = None
) -> dict[str, RepoFile]:
    """The files the Hub lists in a repository at ``revision``, by path (call it under :func:`hub_errors`).

    Args:
        api: The client.
        repo_id: The repository.
        revision: A branch, tag, commit or ``refs/pr/N`` (default: ``main``).
        repo_type: ``"model"`` (default), ``"dataset"`` or ``"space"``.

    Returns:
        Each file's listing (size, ``blob_id``, ``lfs``), by its path in the repository.
    """
    from huggingface_hub.hf_api import RepoFile

    return {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, revision=revision, repo_type=repo_type, recursive=True)
        if isinstance(entry, RepoFile)
    }


def verify_hub_files(
    files: Iterable[HubFile],
    listed: dict[str, RepoFile],
    *,
    repo_id: str,
    revision: str | None = None,
    source: str = "the folder sent",
) -> None:
    """Check that the Hub lists every file sent with the same size and content hash.

    Args:
        files: The files sent.
        listed: What :func:`hub_files` returned after the commit.
        repo_id: The repository (carried by the error).
        revision: The revision listed (``None`` for ``main``).
        source: What the files came from, for the message (``"the release folder"``).

    Raises:
        HubError: A file is missing, or differs in size or hash.
    """
    problems = []
    for f in files:
        remote = listed.get(f.path_in_repo)
        if remote is None:
            problems.append(f"{f.path_in_repo} is missing")
        elif remote.size != f.size:
            problems.append(f"{f.path_in_repo} has {remote.size} bytes, {f.size} were sent")
        else:
            kind, listed_hash, local_hash = (
                ("LFS sha256", remote.lfs.sha256, f.sha256())
                if remote.lfs is not None
                else ("git oid", remote.blob_id, f.git_blob_sha1())
            )
            if listed_hash != local_hash:
                problems.append(f"{f.path_in_repo} has {kind} {listed_hash[:12]}, {local_hash[:12]} was sent")
    if problems:
        where = f"{repo_id}@{revision or 'main'}"
        raise HubError(repo_id, f"After the push, {where} differs from {source}: {'; '.join(problems)}.")
