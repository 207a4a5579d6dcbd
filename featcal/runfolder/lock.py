"""The run folder's lock: one process writes a run folder at a time, and nobody reads it meanwhile.

The lock is an ``flock`` on ``<run>/.featcal.lock``: exclusive for a process that writes the run
(``featcal run``, ``sweep``, ``diagnose``, ``export``), shared for one that only reads it (``featcal
card`` into another folder, ``push`` of a release it does not write). The kernel releases an
``flock`` when its process dies, even by SIGKILL, so a lock left by a killed process is taken over
(and logged) rather than blocking forever. The writer records itself in the file (pid, host, start
time, command). The last holder removes the file: the writer, or a reader that finds no other holder.
A process that locked a file which was removed (and perhaps created again) meanwhile lets it go and
locks the file now at the path, so two processes never hold locks on two different files. Within one
process the lock nests: a run that exports its release holds the lock the export asks for.

A model folder that `featcal merge` or `featcal calibrate` writes (:class:`OutputLock`) takes the same
lock, exclusive, on a file beside it (``.<name>.featcal.lock``): the folder is replaced whole when the
command ends, so a file inside it would go with it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from featcal.errors import RunLockedError
from featcal.runfolder.layout import LOCK_FILE

logger = logging.getLogger(__name__)

_HELD: dict[Path, bool] = {}  # run folders this process holds a lock on -> whether it is shared


class RunLock:
    """A lock on a run folder, held while a process writes (or, ``shared``, reads) it.

    Args:
        run: The run folder (created, for an exclusive lock, when it does not exist yet).
        shared: Take a shared lock: several readers may hold one together, a writer none meanwhile.

    Raises:
        RunLockedError: on entry, when a live process holds the lock in a way that excludes this one.
    """

    def __init__(self, run: Path, *, shared: bool = False) -> None:
        self.run = Path(run)
        self.path = self.lock_path()
        self.shared = shared
        self._fd: int | None = None
        self._nested = False

    def lock_path(self) -> Path:
        """The file the lock is taken on."""
        return self.run / LOCK_FILE

    def __enter__(self) -> RunLock:
        key = self.run.resolve()
        if key in _HELD and (self.shared or not _HELD[key]):  # held here already, and enough
            self._nested = True
            return self
        if not self.shared:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                if self.shared and exc.errno == errno.EROFS:  # nobody writes a read-only folder: nothing to wait for
                    return self
                raise
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(self.run, self._busy_message(holder), holder) from None
            if _is_at_path(fd, self.path):
                break
            os.close(fd)  # removed by its last holder since we opened it: lock the file at the path now
        if not self.shared:
            previous = _read_holder(fd)
            if previous:
                logger.warning(
                    "Run folder %s: taking over the lock left by process %s on %s, which is no longer running",
                    self.run,
                    previous.get("pid", "?"),
                    previous.get("host", "?"),
                )
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(sys.argv[:3]),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        _HELD[key] = self.shared
        return self

    def _busy_message(self, holder: dict[str, Any]) -> str:
        """Why the lock cannot be had, in one line: a writer's record, or readers (who leave none)."""
        if holder:
            who = (
                f"being written by process {holder.get('pid', '?')} on {holder.get('host', '?')} "
                f"(since {holder.get('started', '?')})"
            )
        else:
            who = "being read by another featcal process"
        what = "read" if self.shared else "write"
        return f"Run folder {self.run} is {who}: wait for it to finish, stop it, or {what} another run folder."

    def __exit__(self, *exc: object) -> None:
        if self._nested:
            self._nested = False
            return
        if self._fd is None:
            return
        _HELD.pop(self.run.resolve(), None)
        last = not self.shared
        if self.shared:  # the last reader: nobody else holds it, so it may take it whole
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = True
            except BlockingIOError:
                last = False
        if last:
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class OutputLock(RunLock):
    """The exclusive lock of a model folder a command writes whole (``featcal merge``, ``calibrate``
    ``--output``), on ``.<name>.featcal.lock`` beside it, held from the inputs' check until the folder is
    written: a second writer is refused at once and the first's folder stays whole.

    Args:
        folder: The output folder (its parent is created when it does not exist yet).
        kind: What is written there, for messages (``"calibrated model"``).

    Raises:
        RunLockedError: on entry, when a live process writes the folder.
    """

    def __init__(self, folder: Path, *, kind: str) -> None:
        self.kind = kind
        self._made: list[Path] = []
        super().__init__(folder)

    def lock_path(self) -> Path:
        return self.run.parent / f".{self.run.name}.featcal.lock"

    def __enter__(self) -> OutputLock:
        self._made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        try:
            super().__enter__()
        except BaseException:
            self._remove_made()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._remove_made()

    def _remove_made(self) -> None:
        """Remove the parent folders the lock created, when nothing was written into them."""
        for folder in self._made:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                return

    def _busy_message(self, holder: dict[str, Any]) -> str:
        return (
            f"The {self.kind} folder {self.run} is being written by process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')} (since {holder.get('started', '?')}): wait for it to finish, stop it, or "
            "write another folder."
        )


def _is_at_path(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
