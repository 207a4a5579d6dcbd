"""`featcal card`: write the model card of a run, or of a model folder, into its release or a folder of its own.

One entry for both inputs: a model folder of ``featcal merge`` or ``featcal calibrate``
(:func:`~featcal.release.model_folder.is_model_input`) gets its folder card
(:func:`featcal.release.folder_card.render_folder_card`), a run its run card and images
(:func:`featcal.release.run_card.write_card_files`). Only the card (and its images) change; in a release folder
their entries in ``release_manifest.json`` are updated, so the release still passes the check before a push.
"""

from __future__ import annotations

import logging
from pathlib import Path

from featcal.errors import OutputPathError, ReleaseError
from featcal.files.atomic import atomic_write_text
from featcal.release.card_template import CARD_FILE, check_card_folder
from featcal.release.folder_card import render_folder_card
from featcal.release.manifest import MANIFEST, read_manifest, update_manifest
from featcal.release.model_folder import default_release_folder, is_model_input, is_model_release, read_model_folder
from featcal.release.run_card import write_card_files
from featcal.runfolder.layout import RELEASE_DIR
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import read_run

logger = logging.getLogger(__name__)


def write_card(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
) -> Path:
    """Write ``README.md`` (and a run's results plot) for a run or a model folder into ``out_dir``.

    Only the card and its images change; the weights and the rest of the folder are left as they are.
    In a release folder, the entries of the files in ``release_manifest.json`` are updated, so the
    release still passes :func:`~featcal.release.check.check_release` (an edit by hand does not).

    Args:
        run_dir: The run folder written by ``featcal run``, or a model folder written by ``featcal merge`` or
            ``featcal calibrate`` (a language model's or a T5's).
        out_dir: Where to write the card (default ``<run>/release``, or ``<folder>-release`` beside a model
            folder); created when missing.
        repo_id: The Hub repository the card names (its usage snippet and ``model-index``).
        license: The license in the card's metadata (default: the family's: ``mit`` for CLIP; ``other`` for T5 and
            language models, and the card says none was given).
        template: A Jinja model card template of your own.

    Returns:
        The path of ``README.md``.

    Raises:
        RunFolderError: when the run folder is incomplete, damaged or edited after the run.
        ModelInputError: when a model folder is not one of featcal's that is released on its own.
        ReleaseError: when ``out_dir`` holds another release (of another run or model folder), or an unreadable
            manifest.
        OutputPathError: when ``out_dir`` holds files that are not a featcal card's or release's, or is or lies in
            the model folder.
        RunLockedError: when another process is writing the run folder.
        InvalidParameterError: for a ``repo_id`` that is not ``namespace/name``.
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    if is_model_input(run_dir):  # a model folder of featcal merge / calibrate: no run around it
        card = _write_folder_card(run_dir, out_dir, repo_id=repo_id, license=license, template=template)
    else:
        run_path = Path(run_dir).expanduser()
        out = Path(out_dir).expanduser() if out_dir is not None else run_path / RELEASE_DIR
        inside = run_path.resolve() in out.resolve().parents
        with RunLock(run_path, shared=not inside):  # no other process writes the run meanwhile
            run = read_run(run_path)
            check_card_folder(out)
            card = write_card_files(run, out, repo_id=repo_id, license=license, template=template)
    logger.info("Wrote the model card %s", card)
    return card


def _write_folder_card(
    model_dir: str | Path,
    out_dir: str | Path | None,
    *,
    repo_id: str | None,
    license: str | None,
    template: str | Path | None,
) -> Path:
    """Write a model folder's card (see :func:`write_card`) into ``out_dir`` (default ``<folder>-release``): the
    folder's release, or a new or empty folder outside the model folder."""
    folder = read_model_folder(model_dir)
    out = Path(out_dir).expanduser() if out_dir is not None else default_release_folder(folder.path)
    inside = folder.path.resolve()
    if out.resolve() == inside or inside in out.resolve().parents:
        raise OutputPathError(
            out, f"The card folder {out} is or lies in the model folder {folder.path}: write the card elsewhere."
        )
    if (out / MANIFEST).is_file():
        recorded = read_manifest(out).recipe_sha256
        if not is_model_release(out) or recorded != folder.recipe_sha256:
            raise ReleaseError(
                out,
                f"{out} holds another release (recipe {recorded[:12]}) than that of {folder.path} (recipe "
                f"{folder.recipe_sha256[:12]}): write the card into another folder, or export this folder there.",
            )
    else:
        check_card_folder(out)
    card = render_folder_card(folder, repo_id=repo_id, license=license, template=template)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CARD_FILE
    atomic_write_text(path, str(card))
    update_manifest(out, {CARD_FILE: True})
    return path
