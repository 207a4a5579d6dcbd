"""`featcal space push`: stage exactly the files the Space needs, then upload them in one commit (huggingface_hub's
``upload_folder``, which puts up to 256 files in a commit).

The staged folder holds ``app.py``, ``requirements.txt``, ``README.md`` (the Space header, with the
model in ``models:``), ``space_config.json`` (which sets the model: ``MODEL_ID`` in the Space, no
Space variable needed), the modules of the ``featcal/`` package the app imports, with the data files of their
packages (featcal is not on PyPI: the app imports it from there; :mod:`.package_files` walks the import graph
from ``app.py``), the tasks file if one is given, and one example image per task in ``examples/``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from featcal.errors import FeatcalError, InputError, InvalidParameterError
from featcal.files.atomic import atomic_write_json
from featcal.hub.publishing import HIDDEN_PATTERNS, hub_api, publishing
from featcal.hub.refs import check_repo_id, is_hub_id
from featcal.hub.verification import HubFile, local_files
from featcal.space.examples import collect_examples
from featcal.space.model import space_tasks
from featcal.space.package_files import needed_files
from featcal.space.settings import CONFIG_FILE, DEFAULT_BASE_MODEL_ID, DEFAULT_MODEL_ID, EXAMPLES_DIR, SpaceSettings

logger = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the featcal package this module belongs to
SOURCE_FILES = ("app.py", "requirements.txt")
# `featcal space` run from a checkout of the Space (`python -m featcal space`): entry points beside app.py.
COMMAND_ENTRY = ("featcal.__main__", "featcal.cli", "featcal.cli.space")
CARD = "README.md"
PACKAGE_DIR = "featcal"
# Folders the push owns: files there that are no longer staged are deleted from the Space.
OWNED_PATTERNS = [f"{PACKAGE_DIR}/**", f"{EXAMPLES_DIR}/**"]


@dataclass(frozen=True)
class SpacePushResult:
    """What a push did (or, for a dry run, would upload)."""

    repo_id: str
    files: tuple[HubFile, ...]
    folder: Path | None
    dry_run: bool
    space_url: str | None = None
    commit_url: str | None = None


def space_source() -> Path:
    """The ``space/`` folder of the featcal source tree (app.py, requirements.txt, README.md)."""
    source = PACKAGE_ROOT.parent / "space"
    missing = [name for name in (*SOURCE_FILES, CARD) if not (source / name).is_file()]
    if missing:
        raise FeatcalError(
            f"The Space sources are missing from {source} ({', '.join(missing)}): "
            "run `featcal space push` from a featcal source checkout (pip install -e .)."
        )
    return source


def _hub_id(value: str, name: str) -> str:
    """``value`` if it names a Hub repository rather than a local folder, else an error naming ``name``."""
    if not is_hub_id(value):
        raise InvalidParameterError(
            name,
            value,
            "a Hub model id (namespace/name): the Space downloads it and cannot see folders on this machine "
            "(publish the model first with `featcal push`)",
        )
    return value


def stage_space(
    out: str | Path,
    *,
    model_id: str = DEFAULT_MODEL_ID,
    base_model_id: str | None = None,
    tasks_file: str | Path | None = None,
    suite: str | None = None,
    examples: bool = True,
    progress: bool = True,
) -> Path:
    """Write the Space's files into ``out`` (created; it must not exist or be empty)."""
    from huggingface_hub import SpaceCard

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InputError(out, f"{out} is not empty: pick a new folder for the staged Space.")
    model_id = _hub_id(model_id, "model_id")
    base_model_id = _hub_id(base_model_id, "base_model_id") if base_model_id else None
    tasks_path = Path(tasks_file).expanduser() if tasks_file is not None else None
    # validates the file and the suite
    tasks = space_tasks(SpaceSettings(tasks_file=str(tasks_path) if tasks_path else None, suite=suite))
    source = space_source()
    package = needed_files(PACKAGE_ROOT.parent, source / "app.py", COMMAND_ENTRY)  # read before writing
    out.mkdir(parents=True, exist_ok=True)
    for name in SOURCE_FILES:
        shutil.copy2(source / name, out / name)
    card = SpaceCard.load(source / CARD)
    card.data.models = [model_id, base_model_id or DEFAULT_BASE_MODEL_ID]
    card.save(out / CARD)
    shipped_tasks = f"tasks{tasks_path.suffix}" if tasks_path else None
    if tasks_path:
        shutil.copy2(tasks_path, out / shipped_tasks)
    settings = SpaceSettings(model_id=model_id, base_model_id=base_model_id, tasks_file=shipped_tasks, suite=suite)
    atomic_write_json(out / CONFIG_FILE, settings.to_config())
    for path in package:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PACKAGE_ROOT.parent / path, out / path)
    if examples:
        found = collect_examples(tasks, out / EXAMPLES_DIR, remote=True, progress=progress)
        logger.info("Example images for %d of %d tasks", len(found), len(tasks))
    return out


def push_space(
    repo_id: str,
    *,
    model_id: str = DEFAULT_MODEL_ID,
    base_model_id: str | None = None,
    tasks_file: str | Path | None = None,
    suite: str | None = None,
    private: bool = False,
    token: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
    output: str | Path | None = None,
    examples: bool = True,
    progress: bool = True,
) -> SpacePushResult:
    """Stage the Space (into ``output``, else a temporary folder) and upload it to ``repo_id`` in one commit.

    Creates the Space (Gradio SDK) if it does not exist. A dry run stages and lists the files
    without contacting the Hub.

    Example:
        >>> push_space("me/featcal-demo", model_id="me/clip-vit-b32-ta8-featcal")  # doctest: +SKIP
    """
    check_repo_id(repo_id, namespace=True)
    api = None if dry_run else hub_api(token, endpoint, repo_id=repo_id)  # offline, no token: refused before staging
    with tempfile.TemporaryDirectory(prefix="featcal-space-") as tmp:
        folder = stage_space(
            Path(output) if output else Path(tmp) / "space",
            model_id=model_id,
            base_model_id=base_model_id,
            tasks_file=tasks_file,
            suite=suite,
            examples=examples,
            progress=progress,
        )
        files = local_files(folder)
        kept = folder if output else None
        if api is None:
            return SpacePushResult(repo_id, files, kept, dry_run=True)
        space_url, commit_url = _upload(api, folder, repo_id, private=private)
    return SpacePushResult(repo_id, files, kept, dry_run=False, space_url=space_url, commit_url=commit_url)


def _upload(api, folder: Path, repo_id: str, *, private: bool) -> tuple[str, str]:
    """Create the Space if needed and commit ``folder`` to it; returns the Space and commit URLs."""
    from featcal.version import __version__

    with publishing(api, repo_id):
        url = api.create_repo(repo_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            repo_type="space",
            folder_path=folder,
            commit_message=f"featcal {__version__}: Space for {repo_id}",
            delete_patterns=OWNED_PATTERNS,
            ignore_patterns=HIDDEN_PATTERNS,
        )
    logger.info("Pushed the Space %s: %s", repo_id, info.commit_url)
    return str(url), info.commit_url
