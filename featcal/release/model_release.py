"""Turn a model folder written by featcal (a language model's or a T5's) into a release folder: exactly what
`featcal push` uploads.

A model folder (``featcal merge`` or ``featcal calibrate`` output, :mod:`featcal.release.model_folder`)
has no run folder around it, so its release is made from the folder alone: its weights, configuration,
tokenizer files and generation config, its recipe as published (local paths named by folder name), a
model card and the manifest. The weights are hard-linked from the model folder when both lie on one
file system, so an 8B model's 16 GB are not written twice; they are copied otherwise, once the free
space has been checked. Nothing in the model folder is written: a link shares its file's bytes and
permissions, so nothing is stamped into the weights either (a run's release stamps its recipe into the
safetensors metadata; a model folder's release records it in ``release_manifest.json`` instead).
``config.json`` is copied as it is, or, for a family that edits its released configuration (a T5's
``tie_word_embeddings: false``, :attr:`~featcal.families.base.ReleaseParts.edit_config`), written anew in the
release from the edited contents: never through a link to the model folder's file.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from functools import cache
from pathlib import Path

from featcal.errors import OutputPathError
from featcal.families import get_family
from featcal.files.atomic import atomic_folder, atomic_write_json, atomic_write_text
from featcal.files.model_files import COMPANION_FILES, MODEL_CONFIG, WEIGHTS, WEIGHTS_INDEX
from featcal.files.placing import check_free_space, link_or_copy, same_file_system
from featcal.hub.refs import check_repo_id, local_path
from featcal.model_recipe import RECIPE_FILE
from featcal.outputs import check_output_folder
from featcal.release.card import CARD_FILE
from featcal.release.manifest import MANIFEST, manifest_of, write_manifest
from featcal.release.model_card import mergekit_refs, render_model_card
from featcal.release.model_folder import ModelFolder, default_release_folder, folder_companions, read_model_folder
from featcal.release.published import published_model_recipe, published_ref
from featcal.release.tensors import tensors_sha256_of

logger = logging.getLogger(__name__)

# The names a language-model folder's release may hold (what a new export may replace).
RELEASE_NAMES = re.compile(
    "|".join(
        [
            *map(re.escape, (MODEL_CONFIG, WEIGHTS, WEIGHTS_INDEX, RECIPE_FILE, CARD_FILE, MANIFEST, *COMPANION_FILES)),
            r"model-\d+-of-\d+\.safetensors",
        ]
    )
)


@cache
def release_names(family: str) -> re.Pattern[str]:
    """The names the release of a model folder of ``family`` may hold: :data:`RELEASE_NAMES` and the files the
    family carries beside its weights (:func:`~featcal.release.model_folder.folder_companions`)."""
    extra = sorted(set(folder_companions(family)) - set(COMPANION_FILES))
    return re.compile("|".join([RELEASE_NAMES.pattern, *map(re.escape, extra)]))


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


def _local_inputs(folder: ModelFolder) -> list[Path]:
    """The local folders the model folder's recipe names (base, experts, the merge it started from): a
    release may not replace or lie in any of them."""
    recipe = folder.recipe
    refs = [recipe.base_model, *recipe.experts.values(), recipe.merge.merged_from]
    paths = [local_path(ref) for ref in refs if ref]
    return [folder.path, *(p for p in paths if p is not None and p.exists())]


def _check_release_target(out: Path) -> None:
    """An existing, non-empty output folder must be an earlier release (it has a manifest): a model folder
    holds the same names as a release, and must never be replaced by one."""
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


def export_model_release(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
) -> Path:
    """Write the release folder of a model folder (default: the sibling ``<folder>-release``): a language
    model's or a T5's (the families with a ``folder_card_template``; a CLIP stage folder is released from its run).

    The release holds the weights (``model.safetensors``, or the shards and ``model.safetensors.index.json``),
    ``config.json`` (as the family releases it: a FLAN-T5-style T5's with ``tie_word_embeddings: false``), the
    tokenizer files (a T5's ``spiece.model`` too) and ``generation_config.json`` of the folder, its
    ``featcal_recipe.json`` as published (local inputs named ``local:<folder name>``), the model card
    (``README.md``) and ``release_manifest.json``: the SHA-256 of every other file, the recipe's hash
    (``recipe_sha256``: :func:`featcal.files.hashing.config_hash` of the folder's recipe) and the tensors'
    (``tensors_sha256``: :func:`featcal.release.tensors.tensors_sha256_of` of the weight files).

    The weights are hard links to the model folder's files when both folders are on one file system, else
    copies; the free space is checked against the bytes to write before anything is written. The folder
    is written in a temporary folder beside it and renamed into place, so it is never seen half-written.
    The model folder is only read.

    Args:
        model_dir: The model folder written by ``featcal merge`` or ``featcal calibrate``.
        out_dir: Where to write the release (default ``<model_dir>-release`` beside it); an earlier release
            there is replaced, any other non-empty folder is refused, as is a folder that is, holds or lies
            in the model folder or a local input of its recipe.
        repo_id: The Hub repository the card names.
        license: The license in the card's metadata; None gives the family's default, and where it has none
            (language models, T5s) ``other``, and the card says none was given.
        template: A Jinja model card template of your own.

    Returns:
        The release folder.

    Raises:
        ModelInputError: when ``model_dir`` is not a model folder of featcal's that is released on its own (no
            recipe, a CLIP model, no readable config, missing weights or shards).
        OutputPathError: when ``out_dir`` may not be written or replaced.
        NoSpaceError: when its file system has less free space than the release needs.
        InvalidParameterError: for a ``repo_id`` that is not ``namespace/name``.
        FeatcalError: when the card's template fails to render.
    """
    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    folder = read_model_folder(model_dir)
    out = Path(out_dir).expanduser() if out_dir is not None else default_release_folder(folder.path)
    check_output_folder(out, kind="release", allowed=release_names(folder.family), inputs=_local_inputs(folder))
    _check_release_target(out)
    card = render_model_card(folder, repo_id=repo_id, license=license, template=template)
    published = published_model_recipe(folder.raw_recipe, mergekit_refs(folder.recipe))
    link = same_file_system(folder.path, out)
    check_free_space(out, bytes_to_write(folder, link=link))
    with atomic_folder(out) as tmp:
        linked = [link_or_copy(folder.path / name, tmp / name, link=link) for name in folder.weights]
        write_config(folder, tmp)
        for name in (*([folder.index] if folder.index else []), *folder.companions):
            shutil.copyfile(folder.path / name, tmp / name)
        atomic_write_json(tmp / RECIPE_FILE, published)
        atomic_write_text(tmp / CARD_FILE, str(card))
        tensors = tensors_sha256_of([tmp / name for name in folder.weights])
        names = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
        source = {"model_folder": published_ref(str(folder.path.resolve())), "kind": folder.recipe.kind}
        write_manifest(tmp, manifest_of(tmp, names, recipe=folder.recipe_sha256, tensors=tensors, source=source))
    logger.info(
        "Exported %s (recipe %s) to %s; weights %s",
        folder.path,
        folder.recipe_sha256[:12],
        out,
        "hard-linked" if all(linked) else "copied" if not any(linked) else "partly hard-linked, partly copied",
    )
    return out
