"""Files and folders that appear whole or not at all: written as hidden temporaries and renamed into place.

A temporary is named ``.<name>.<pid>.XXXX`` beside its target, after the process that writes it, so
that what a killed process leaves behind is removed by the next write of the same target
(:func:`remove_stale_temporaries`), and by the next run in a run folder (:mod:`featcal.runfolder.leftovers`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError
from featcal.files.faults import fault_point


def current_umask() -> int:
    """The process's file-creation mask (read without changing it for long)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_if_created(path: str | Path, *, folder: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would have: 0666/0777 less the umask.

    ``tempfile`` creates private files (0600) and folders (0700); what featcal renames into place
    from there is meant to be read by the user's group and the Hub client like any other output.
    """
    os.chmod(path, (0o777 if folder else 0o666) & ~current_umask())


def as_if_created_tree(folder: str | Path) -> None:
    """:func:`as_if_created` on ``folder`` and everything in it (libraries such as safetensors create
    their files private), except hard links to files elsewhere: a link shares its file's inode, so its
    permissions are that file's, which are not featcal's to change."""
    folder = Path(folder)
    as_if_created(folder, folder=True)
    for path in folder.rglob("*"):
        if path.is_dir() or path.lstat().st_nlink == 1:
            as_if_created(path, folder=path.is_dir())


def _temporary_prefix(target: Path) -> str:
    """The name prefix of this process's temporaries for ``target``."""
    return f".{target.name}.{os.getpid()}."


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: str | Path) -> list[Path]:
    """Remove the temporaries of ``target`` that processes which no longer run left beside it.

    Args:
        target: A file or folder featcal writes through a temporary sibling.

    Returns:
        What was removed.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\..+")
    removed = []
    for entry in target.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path), suffix=".tmp")
    try:
        as_if_created(tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as strict JSON (``NaN`` and ``Infinity`` are refused with a ValueError)."""
    atomic_write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place, replacing any previous one."""
    fault_point(f"replace:{final.name}")
    if final.exists() and not final.is_dir():
        raise FeatcalError(f"{final} exists and is a file: choose another output folder.")
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


@contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``folder`` (``.name.<pid>.XXXX``: stale ones of dead processes are removed first,
    see :func:`remove_stale_temporaries`) to write into; renamed to ``folder``, replacing it, when the block ends
    (what it holds given the permissions of files created under the umask: mkdtemp and safetensors create private
    ones), and removed when it raises.

    Args:
        folder: The folder to write.

    Yields:
        The temporary folder.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temporary_prefix(folder)))
    try:
        yield tmp
        as_if_created_tree(tmp)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
