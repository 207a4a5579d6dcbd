"""What killed processes leave in a run folder: hidden temporaries of featcal's atomic writes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from featcal.runfolder.layout import LOCK_FILE

logger = logging.getLogger(__name__)


def remove_leftovers(run: Path) -> list[Path]:
    """Remove what killed runs leave behind: hidden temporary files and folders of featcal's writes.

    featcal writes every file and model folder as a hidden temporary (``.name.XXXX``) renamed into
    place; a run killed mid-write leaves one. Only entries of that shape in the run folder and its
    stage folders are removed (the lock file is the caller's). Returns what was removed.
    """
    removed = []
    folders = [run, *(p for p in run.iterdir() if p.is_dir() and not p.name.startswith("."))]
    for folder in folders:
        for entry in folder.iterdir():
            if not entry.name.startswith(".") or entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        logger.info("Removed %d leftover(s) of an interrupted run in %s", len(removed), run)
    return removed
