"""The release of a language-model run: its released stage folder released as a model folder is
(:mod:`featcal.release.model_release`), with the run's evaluation and a card of its results.

The released stage (``featcal-ta/``, else ``ta/``) is a model folder of featcal's with its recipe, so the
release holds what a model folder's does: the weights (hard links when on one file system, else copies,
the free space checked first), ``config.json``, the tokenizer files and generation config,
``featcal_recipe.json`` as published; and besides, the stage's ``metrics.json`` (stamped with the run's id)
and a card with the run's results (:mod:`featcal.release.lm_run_card`). ``release_manifest.json`` names the
run's id as its recipe, and the stage and the SHA-256 of its weight files as its source, so that a push
refuses a release whose stage was redone since. Nothing is stamped into the weights (they may be links);
a push checks the release as a model folder's (:func:`featcal.release.model_check.check_model_release`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from featcal.errors import ReleaseError
from featcal.files.atomic import atomic_folder, atomic_write_json, atomic_write_text
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.placing import check_free_space, link_or_copy, same_file_system
from featcal.metrics import RUN_ID
from featcal.model_recipe import RECIPE_FILE
from featcal.outputs import check_output_folder
from featcal.release.card import CARD_FILE, check_card_folder
from featcal.release.lm_run_card import render_run_card
from featcal.release.manifest import MANIFEST, manifest_of, read_manifest, update_manifest, write_manifest
from featcal.release.model_card import mergekit_refs
from featcal.release.model_folder import ModelFolder, read_model_folder, releases_run_as_folder
from featcal.release.model_release import RELEASE_NAMES, bytes_to_write
from featcal.release.published import published_model_recipe, published_ref
from featcal.release.tensors import tensors_sha256_of
from featcal.runfolder.layout import METRICS, RELEASE_DIR, RUN_CONFIG
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import RunFolder, read_run

logger = logging.getLogger(__name__)

# A run's language-model release: a model folder's release and the stage's metrics.json.
RUN_RELEASE_NAMES = re.compile(f"{RELEASE_NAMES.pattern}|{re.escape(METRICS)}")


def export_lm_run_release(
    run: RunFolder,
    out: Path,
    source: dict,
    *,
    repo_id: str | None,
    license: str | None,
    template: str | Path | None,
) -> Path:
    """Write the release of a language-model run into ``out`` (under the run's lock, held by the caller).

    Args:
        run: The run folder, read and checked.
        out: The release folder: new, or an earlier release, replaced.
        source: The released stage and its weights' SHA-256 (:func:`featcal.release.export.released_source`).
        repo_id: The Hub repository the card names.
        license: The license in the card (None: ``other``, and the card says none was given).
        template: A Jinja model card template of your own.

    Returns:
        The release folder.

    Raises:
        ModelInputError: when the released stage is not a language-model folder of featcal's.
        OutputPathError: when ``out`` holds other files than a release's.
        NoSpaceError: when its file system has less free space than the release needs.
        FeatcalError: when the card's template fails to render.
    """
    folder = read_model_folder(run.released.path)
    check_output_folder(out, kind="release", allowed=RUN_RELEASE_NAMES, inputs=[folder.path])
    card = render_run_card(run, folder, repo_id=repo_id, license=license, template=template)
    published = published_model_recipe(folder.raw_recipe, mergekit_refs(folder.recipe))
    link = same_file_system(folder.path, out)
    check_free_space(out, bytes_to_write(folder, link=link))
    with atomic_folder(out) as tmp:
        for name in folder.weights:
            link_or_copy(folder.path / name, tmp / name, link=link)
        for name in (MODEL_CONFIG, *([folder.index] if folder.index else []), *folder.companions):
            shutil.copyfile(folder.path / name, tmp / name)
        atomic_write_json(tmp / RECIPE_FILE, published)
        atomic_write_json(tmp / METRICS, {**run.released.metrics, RUN_ID: run.recipe_sha256})
        atomic_write_text(tmp / CARD_FILE, str(card))
        tensors = tensors_sha256_of([tmp / name for name in folder.weights])
        names = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
        origin = {**source, "model_folder": published_ref(str(folder.path.resolve())), "kind": folder.recipe.kind}
        write_manifest(tmp, manifest_of(tmp, names, recipe=run.recipe_sha256, tensors=tensors, source=origin))
    logger.info("Exported %s (stage %s, run %s) to %s", run.path, run.released.name, run.recipe_sha256[:12], out)
    return out


def is_lm_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` is a run folder whose record names the language-model family.

    Args:
        run_dir: A folder given to ``featcal card``.

    Returns:
        True for a run folder of ``causal_lm`` models; False for another folder or family (or no readable
        record, which the card command then names).
    """
    path = Path(run_dir).expanduser() / RUN_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    family = data.get("family") if isinstance(data, dict) else None
    return isinstance(family, str) and releases_run_as_folder(family)


def write_lm_run_card(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
) -> Path:
    """Write ``README.md`` of a language-model run into ``out_dir`` (default its release ``RUN/release``, else
    a new or empty folder), updating the release's manifest entry.

    Args:
        run_dir: The run folder.
        out_dir: Where to write the card.
        repo_id: The Hub repository the card names.
        license: The license in the card's metadata (None: ``other``).
        template: A Jinja model card template of your own.

    Returns:
        The path of ``README.md``.

    Raises:
        RunFolderError: when the run folder is incomplete or damaged.
        ReleaseError: when ``out_dir`` holds the release of another run.
        OutputPathError: when ``out_dir`` holds files that are not a featcal card's or release's.
        RunLockedError: when another process is writing the run folder.
        FeatcalError: when the template fails to render.
    """
    run_path = Path(run_dir).expanduser()
    out = Path(out_dir).expanduser() if out_dir is not None else run_path / RELEASE_DIR
    with RunLock(run_path, shared=run_path.resolve() not in out.resolve().parents):
        run = read_run(run_path)
        return _write_card(run, out, repo_id=repo_id, license=license, template=template)


def _write_card(
    run: RunFolder, out: Path, *, repo_id: str | None, license: str | None, template: str | Path | None
) -> Path:
    if (out / MANIFEST).is_file():
        recorded = read_manifest(out).recipe_sha256
        if recorded != run.recipe_sha256:
            raise ReleaseError(
                out,
                f"{out} holds the release of another run (recipe {recorded[:12]}) than {run.path} "
                f"(recipe {run.recipe_sha256[:12]}): write the card into another folder, or export this run there.",
            )
    else:
        check_card_folder(out)
    folder: ModelFolder = read_model_folder(run.released.path)
    card = render_run_card(run, folder, repo_id=repo_id, license=license, template=template)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CARD_FILE
    atomic_write_text(path, str(card))
    update_manifest(out, {CARD_FILE: True})
    return path
