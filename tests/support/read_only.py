"""A folder that behaves as the root of a read-only file system, for the tests of outputs placed on one.

Mounting one needs privileges the tests do not have (and root ignores file permissions), so the calls
that change a file system are refused below the folder with EROFS, as Linux refuses them: after the
path's lookup (making a folder that exists is EEXIST, removing a file that does not is ENOENT).
Reading is left alone.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

import pytest

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Refuse every creation, write, rename and removal in ``folder`` and below, for the test's duration."""
    root = os.path.abspath(folder)
    real = {name: getattr(os, name) for name in ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir")}
    real_open = builtins.open

    def inside(path) -> bool:
        if isinstance(path, int):  # an open file descriptor: already past the refusal
            return False
        path = os.path.abspath(os.fsdecode(path))
        return path == root or path.startswith(root + os.sep)

    def refuse(path) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITES and inside(path):
            refuse(path)
        return real["open"](path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.lexists(path):
            refuse(path)
        return real["mkdir"](path, *args, **kwargs)

    def moved(name):
        def move(src, dst, *args, **kwargs):
            for path in (src, dst):
                if inside(path):
                    refuse(path)
            return real[name](src, dst, *args, **kwargs)

        return move

    def removed(name):
        def remove(path, *args, **kwargs):
            if inside(path) and os.path.lexists(path):
                refuse(path)
            return real[name](path, *args, **kwargs)

        return remove

    def open_file(file, mode="r", *args, **kwargs):
        if inside(file) and set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, moved(name))
    for name in ("unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, removed(name))
    monkeypatch.setattr(builtins, "open", open_file)
    monkeypatch.setattr(io, "open", open_file)  # pathlib's Path.open
