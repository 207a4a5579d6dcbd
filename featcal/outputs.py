"""Checks of where a command will write, made before any heavy work.

Every folder featcal writes appears whole, replacing what was there (:func:`featcal.files.atomic.atomic_folder`).
So a command checks first that what it would replace is its own kind of output: a missing or empty
folder, or one holding only the files that kind of output has (a model folder that featcal's recipe
marks as featcal's may also hold the base's tokenizer files and generation config it was written
with); never a file, never one of the command's own inputs, never a folder that holds or lies inside
an input.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from featcal.errors import FeatcalError, InvalidParameterError, OutputPathError
from featcal.files.model_files import COMPANION_FILES

# What `featcal merge` / `featcal calibrate` write, and what a folder may hold to be replaced by them.
MODEL_FOLDER_FILES = re.compile(
    r"(config\.json|metrics\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d+-of-\d+\.safetensors|generation_config\.json|featcal_recipe\.json|mergekit_config\.yml)"
)


def _writable_parent(path: Path, shown: str | Path) -> None:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(shown, f"Cannot write {shown}: {parent} is a file, not a folder. Choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(shown, f"Cannot write {shown}: no write permission in {parent}. Choose another path.")


def _overlaps(path: Path, other: Path) -> bool:
    return path == other or path in other.parents or other in path.parents


def check_output_folder(
    folder: str | Path,
    *,
    kind: str,
    allowed: re.Pattern[str] = MODEL_FOLDER_FILES,
    inputs: Iterable[str | Path] = (),
) -> Path:
    """The folder a command will write (replacing it), checked before the command's work.

    Args:
        folder: The output folder as the user gave it.
        kind: What the command writes there, for messages (``"merged model"``).
        allowed: The names a replaceable folder may hold (anything else is someone else's).
        inputs: The command's local input paths: the output may be none of them, hold none and lie in none.

    Returns:
        The folder as an absolute path.

    Raises:
        OutputPathError: for an empty path, a file, a folder holding other files, an input, or a
            place that cannot be written.
    """
    if not str(folder).strip():
        raise OutputPathError(folder, f"The {kind} folder is an empty path: name a folder.")
    path = Path(folder).expanduser().resolve()
    if path == Path.cwd().resolve() or path.parent == path:
        raise OutputPathError(folder, f"The {kind} folder {folder} is the current or root folder: name a new folder.")
    for item in inputs:
        other = Path(item).expanduser().resolve()
        if _overlaps(path, other):
            raise OutputPathError(
                folder,
                f"The {kind} folder {folder} would replace the input {item} (or a folder holding it): "
                "choose another output folder.",
            )
    if path.exists() and not path.is_dir():
        raise OutputPathError(folder, f"The {kind} folder {folder} exists and is a file: choose another path.")
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if not allowed.fullmatch(p.name))
        if foreign and allowed is MODEL_FOLDER_FILES and _written_by_featcal(path):
            foreign = [name for name in foreign if name not in COMPANION_FILES]
        if foreign:
            raise OutputPathError(
                folder,
                f"{folder} exists and holds files that are not a {kind}'s ({', '.join(foreign[:5])}): "
                "choose another output folder, or remove them.",
            )
    _writable_parent(path, folder)
    return path


def _written_by_featcal(folder: Path) -> bool:
    """Whether ``folder`` is a model folder featcal wrote: its ``featcal_recipe.json`` reads as featcal's
    recipe (the base's tokenizer files beside it are then featcal's copies)."""
    from featcal.model_recipe import read_model_recipe

    try:
        return read_model_recipe(folder) is not None
    except FeatcalError:
        return False


def check_output_file(path: str | Path, *, kind: str) -> Path:
    """A file a command will write (replacing it), checked before the command's work.

    Args:
        path: The output file as the user gave it.
        kind: What the command writes there, for messages (``"metrics file"``).

    Returns:
        The file as an absolute path.

    Raises:
        OutputPathError: for an empty path, a folder, or a place that cannot be written.
    """
    if not str(path).strip():
        raise OutputPathError(path, f"The {kind} is an empty path: name a file.")
    resolved = Path(path).expanduser().resolve()
    if resolved.is_dir():
        raise OutputPathError(path, f"The {kind} {path} is a folder: name a file (in it, or elsewhere).")
    _writable_parent(resolved, path)
    return resolved


def check_run_output_folder(out: Path) -> None:
    """Refuse an output path that is a file, or a folder that holds other things than a featcal run.

    Raises:
        InvalidParameterError: naming ``output_dir``.
    """
    if out.exists() and not out.is_dir():
        raise InvalidParameterError("output_dir", str(out), "a folder, not an existing file")
    from featcal.runfolder.layout import RUN_CONFIG

    if out.is_dir() and not (out / RUN_CONFIG).is_file():
        visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if visible:
            raise InvalidParameterError(
                "output_dir",
                str(out),
                f"a new or empty folder, or a featcal run folder; it holds {', '.join(visible[:3])}",
            )


def enclosing_run(path: Path) -> Path | None:
    """The run folder ``path`` lies in (the nearest folder above it holding ``run_config.json``), if any."""
    from featcal.runfolder.layout import RUN_CONFIG

    return next((folder for folder in path.parents if (folder / RUN_CONFIG).is_file()), None)


def check_metrics_output(path: Path, *, inputs: Iterable[str | Path] = ()) -> Path | None:
    """Refuse a metrics file that would replace something that is not a metrics report of featcal's.

    ``path`` (absolute, checked by :func:`check_output_file`) may not be one of ``inputs`` nor lie in
    one (a model folder, the base, a dataset folder, the tasks file); it may not replace a file that is
    not a featcal metrics report; inside a run folder it may only lie in the run's ``evaluations/``
    folder (a stage's ``metrics.json`` is the stage's record, tied to its weights), and never inside a
    release.

    Returns:
        The run folder whose ``evaluations/`` receives the file (the caller writes it under that run's
        lock), or None.

    Raises:
        OutputPathError: naming the path and where to write instead.
    """
    from featcal.release.manifest import MANIFEST
    from featcal.runfolder.layout import EVALUATIONS_DIR

    for item in inputs:
        other = Path(item).expanduser().resolve()
        if path == other or other in path.parents:
            raise OutputPathError(
                path, f"The metrics file {path} would replace the input {item} or a file in it: write it elsewhere."
            )
    release = next((folder for folder in path.parents if (folder / MANIFEST).is_file()), None)
    if release is not None:
        raise OutputPathError(path, f"{path} lies in the release {release}: write the metrics elsewhere.")
    run = enclosing_run(path)
    if run is not None and path.parent != run / EVALUATIONS_DIR:
        raise OutputPathError(
            path,
            f"{path} lies in the run folder {run}, whose files are the run's own records: write it as "
            f"{run / EVALUATIONS_DIR / path.name} (the run's folder for other evaluations), or outside the run.",
        )
    if path.exists() and not _is_metrics_report(path):
        raise OutputPathError(
            path, f"{path} exists and is not a featcal metrics report: name a new file, or remove it first."
        )
    return run


def _is_metrics_report(path: Path) -> bool:
    """Whether ``path`` holds a metrics report as featcal writes one (its ``average`` with an accuracy, or a
    loss alone for a language model's)."""
    import json

    from featcal.metrics import AVERAGE, is_task_result

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and is_task_result(data.get(AVERAGE))
