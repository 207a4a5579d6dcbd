"""Large files put into an output folder without a second copy where the file system allows: hard links.

A hard link is a second name of the same file (the same inode): no byte is written, and the file's
contents, permissions and times are shared. Whoever holds a link must therefore never write the file
in place (featcal replaces files by renaming a new one over them, which leaves a link's file as it was).
Links work only within one file system; elsewhere the file is copied, once there is room for it.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from featcal.errors import NoSpaceError

logger = logging.getLogger(__name__)

# What os.link raises where a file system has no hard links, or not for this file: copy instead.
NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES})


def existing_ancestor(path: Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent folder."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def same_file_system(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` (or, for a path not there yet, its nearest existing folder) are on one
    file system (the same ``st_dev``), where a hard link from one to the other can be made."""
    return existing_ancestor(a).stat().st_dev == existing_ancestor(b).stat().st_dev


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse to write ``needed`` bytes into ``folder`` when its file system has fewer free.

    Args:
        folder: Where the bytes go (it need not exist yet: its nearest existing parent is measured).
        needed: The bytes to be written.

    Raises:
        NoSpaceError: naming the folder, the bytes needed and the bytes free.
    """
    free = shutil.disk_usage(existing_ancestor(folder)).free
    if needed > free:
        raise NoSpaceError(folder, needed, free)


def link_or_copy(source: Path, target: Path, *, link: bool) -> bool:
    """Put ``source`` at ``target`` as a hard link when ``link`` is True and the file system makes one,
    else as a copy (of the bytes only: the copy is a new file of the writer's).

    A copy that a failed link forces is checked against the free space first.

    Args:
        source: The file.
        target: Its new name (which must not exist).
        link: Try a hard link first.

    Returns:
        True when ``target`` is a hard link to ``source``, False for a copy.

    Raises:
        NoSpaceError: when a link could not be made and the copy does not fit.
    """
    if link:
        try:
            os.link(source, target)
            return True
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            logger.info("No hard link from %s to %s (%s): copying it", source, target, exc.strerror)
    check_free_space(target.parent, source.stat().st_size)
    shutil.copyfile(source, target)
    return False
