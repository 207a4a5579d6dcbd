"""Write the release of a model folder of featcal's (a language model's or a T5's): exactly what `featcal push`
uploads. :func:`featcal.release.export.export_release` writes it for a model folder on its own, and for a run whose
family releases it as its released stage's folder (a language model's run: with the stage's ``metrics.json``).

A model folder (``featcal merge`` or ``featcal calibrate`` output, or a run's stage:
:mod:`featcal.release.model_folder`) is released from the folder: its weights, configuration, tokenizer files and
generation config, its recipe as published (local paths named by folder name), a model card and the manifest. The
weights are hard-linked from the model folder when both lie on one file system, so an 8B model's 16 GB are not
written twice; they are copied otherwise, once the free space has been checked. Nothing in the model folder is
written: a link shares its file's bytes and permissions, so nothing is stamped into the weights either (a run's own
release stamps its recipe into the safetensors metadata; a model folder's release records it in
``release_manifest.json`` instead). ``config.json`` is copied as it is, or, for a family that edits its released
configuration (a T5's ``tie_word_embeddings: false``, :attr:`~featcal.families.base.ReleaseParts.edit_config`),
written anew in the release from the edited contents: never through a link to the model folder's file.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from featcal.errors import OutputPathError
from featcal.families import get_family
from featcal.files.atomic import atomic_folder, atomic_write_json, atomic_write_text
from featcal.files.model_files import COMPANION_FILES, MODEL_CONFIG, WEIGHTS, WEIGHTS_INDEX
from featcal.files.placing import check_free_space, link_or_copy, same_file_system
from featcal.hub.refs import local_path
from featcal.model_recipe import RECIPE_FILE
from featcal.outputs import check_output_folder
from featcal.release.card_template import CARD_FILE
from featcal.release.folder_card import mergekit_refs
from featcal.release.manifest import MANIFEST, manifest_of, write_manifest
from featcal.release.model_folder import ModelFolder, folder_companions
from featcal.release.published import published_model_recipe, published_ref
from featcal.release.tensors import tensors_sha256_of
from featcal.runfolder.layout import METRICS

logger = logging.getLogger(__name__)

# The names a model folder's release may hold (what a new export may replace).
RELEASE_NAMES = re.compile(
    "|".join(
        [
            *map(re.escape, (MODEL_CONFIG, WEIGHTS, WEIGHTS_INDEX, RECIPE_FILE, CARD_FILE, MANIFEST, *COMPANION_FILES)),
            r"model-\d+-of-\d+\.safetensors",
        ]
    )
)


@cache
def release_names(family: str, *, with_metrics: bool = False) -> re.Pattern[str]:
    """The names the release of a model folder of ``family`` may hold: :data:`RELEASE_NAMES` and the files the
    family carries beside its weights (:func:`~featcal.release.model_folder.folder_companions`).

    Args:
        family: The model folder's family.
        with_metrics: Whether the release holds ``metrics.json`` too (that of a run's stage).

    Returns:
        The pattern the names must match in full.
    """
    extra = sorted(set(folder_companions(family)) - set(COMPANION_FILES))
    return re.compile(
        "|".join([RELEASE_NAMES.pattern, *map(re.escape, extra), *([re.escape(METRICS)] if with_metrics else [])])
    )


def write_config(folder: ModelFolder, out: Path) -> None:
    """Write the release's ``config.json`` into ``out``: the model folder's bytes, or the family's edit of them
    (:attr:`~featcal.families.base.ReleaseParts.edit_config`) when it changes anything. Either way a new file
    is written in ``out``, never a link, so the model folder's own file is never written through.

    Args:
        folder: The model folder.
        out: The release folder being written (nothing named ``config.json`` in it yet).
    """
    source, target = folder.path / MODEL_CONFIG, out / MODEL_CONFIG
    edit = get_family(folder.family).release.edit_config
    if edit is not None:
        config = json.loads(source.read_text(encoding="utf-8"))
        edited = edit(config)
        if edited != config:
            target.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            return
    shutil.copyfile(source, target)


# Room kept beside the files' own bytes for the card, the published recipe and the manifest.
SMALL_FILES_MARGIN = 1 << 20


def local_inputs(folder: ModelFolder) -> list[Path]:
    """The model folder and the local folders its recipe names (base, experts, the merge it started from): a
    release may not replace or lie in any of them.

    Args:
        folder: The model folder.

    Returns:
        The folders, the model folder first.
    """
    recipe = folder.recipe
    refs = [recipe.base_model, *recipe.experts.values(), recipe.merge.merged_from]
    paths = [local_path(ref) for ref in refs if ref]
    return [folder.path, *(p for p in paths if p is not None and p.exists())]


def check_release_target(out: Path) -> None:
    """An existing, non-empty output folder must be an earlier release (it has a manifest): a model folder
    holds the same names as a release, and must never be replaced by one.

    Args:
        out: The release folder to write.

    Raises:
        OutputPathError: naming the folder.
    """
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OutputPathError(
            out,
            f"{out} exists and is not a featcal release (it has no {MANIFEST}): choose a new or empty folder, "
            "or remove it first.",
        )


def bytes_to_write(folder: ModelFolder, *, link: bool) -> int:
    """The bytes a release of ``folder`` writes: its small files (and a margin for the card, recipe and
    manifest), and its weights unless they are hard-linked.

    Args:
        folder: The model folder.
        link: Whether the weights will be hard links.

    Returns:
        A number of bytes.
    """
    small = [MODEL_CONFIG, *folder.companions, *([folder.index] if folder.index else [])]
    total = sum((folder.path / name).stat().st_size for name in small) + SMALL_FILES_MARGIN
    if not link:
        total += sum((folder.path / name).stat().st_size for name in folder.weights)
    return total


def write_folder_release(
    folder: ModelFolder,
    out: Path,
    *,
    card: Callable[[], ModelCard],
    recipe_sha256: str,
    allowed: re.Pattern[str],
    inputs: list[Path],
    metrics: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    release_only: bool = False,
) -> Path:
    """Write the release of the model folder ``folder`` into ``out`` (new, or an earlier release, replaced).

    The release holds the weights (``model.safetensors``, or the shards and ``model.safetensors.index.json``),
    ``config.json`` (as the family releases it: a FLAN-T5-style T5's with ``tie_word_embeddings: false``), the
    tokenizer files (a T5's ``spiece.model`` too) and ``generation_config.json`` of the folder, its
    ``featcal_recipe.json`` as published (local inputs named ``local:<folder name>``), ``metrics`` as
    ``metrics.json`` when given, the model card (``README.md``) and ``release_manifest.json``: the SHA-256 of every
    other file, ``recipe_sha256`` and the tensors' hash (``tensors_sha256``:
    :func:`featcal.release.tensors.tensors_sha256_of` of the weight files), and ``source`` (with the model folder
    and its kind).

    The weights are hard links to the model folder's files when both folders are on one file system, else
    copies; the free space is checked against the bytes to write before anything is written. The folder
    is written in a temporary folder beside it and renamed into place, so it is never seen half-written.
    The model folder is only read.

    Args:
        folder: The model folder, read.
        out: The release folder.
        card: Renders the model card; called once ``out`` has been checked.
        recipe_sha256: The recipe the manifest names (the folder's, or its run's).
        allowed: The names a release in ``out`` may hold (what a new export may replace).
        inputs: The folders ``out`` may not be, hold or lie in.
        metrics: The evaluation report the release ships (a run's stage's), or None.
        source: What the manifest says the release was made from, besides the model folder (a run's stage).
        release_only: Whether a non-empty ``out`` must be an earlier release (:func:`check_release_target`; a
            model folder's own release), else it may hold any of ``allowed`` (a run's release folder, which
            may hold a card written before).

    Returns:
        The release folder.

    Raises:
        OutputPathError: when ``out`` may not be written or replaced.
        NoSpaceError: when its file system has less free space than the release needs.
        FeatcalError: when the card's template fails to render.
    """
    check_output_folder(out, kind="release", allowed=allowed, inputs=inputs)
    if release_only:
        check_release_target(out)
    rendered = card()
    published = published_model_recipe(folder.raw_recipe, mergekit_refs(folder.recipe))
    link = same_file_system(folder.path, out)
    check_free_space(out, bytes_to_write(folder, link=link))
    with atomic_folder(out) as tmp:
        linked = [link_or_copy(folder.path / name, tmp / name, link=link) for name in folder.weights]
        write_config(folder, tmp)
        for name in (*([folder.index] if folder.index else []), *folder.companions):
            shutil.copyfile(folder.path / name, tmp / name)
        atomic_write_json(tmp / RECIPE_FILE, published)
        if metrics is not None:
            atomic_write_json(tmp / METRICS, metrics)
        atomic_write_text(tmp / CARD_FILE, str(rendered))
        tensors = tensors_sha256_of([tmp / name for name in folder.weights])
        names = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
        origin = {
            **(source or {}),
            "model_folder": published_ref(str(folder.path.resolve())),
            "kind": folder.recipe.kind,
        }
        write_manifest(tmp, manifest_of(tmp, names, recipe=recipe_sha256, tensors=tensors, source=origin))
    logger.info(
        "Exported %s (recipe %s) to %s; weights %s",
        folder.path,
        recipe_sha256[:12],
        out,
        "hard-linked" if all(linked) else "copied" if not any(linked) else "partly hard-linked, partly copied",
    )
    return out
