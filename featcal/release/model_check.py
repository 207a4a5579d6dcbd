"""Check that a model folder's release (a language model's or a T5's) is complete and unchanged since export,
without loading it.

An 8B model is never loaded to be checked: its configuration is read by transformers, each weight
file's safetensors header is parsed (every tensor's bytes inside the file, the shard index naming
exactly the tensors the shards hold), and every file is hashed against ``release_manifest.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from featcal.errors import ModelInputError, ReleaseError
from featcal.files.hashing import file_sha256
from featcal.hub.verification import HubFile, local_files
from featcal.model_recipe import RECIPE_FILE, ModelRecipe
from featcal.release.card import CARD_FILE
from featcal.release.check import Release
from featcal.release.manifest import MANIFEST, read_manifest
from featcal.release.model_folder import folder_families, releases_folders, weight_files
from featcal.release.tensors import read_header

FIX = "rebuild it with `featcal export MODEL_FOLDER`"


def _check_listing(folder: Path, files: tuple[HubFile, ...], recorded: dict[str, str]) -> None:
    """The folder holds exactly the files of the manifest (hidden files, which a push skips, aside)."""
    present = {f.path_in_repo for f in files} - {MANIFEST}
    missing = sorted(set(recorded) - present)
    if missing:
        raise ReleaseError(
            folder / missing[0], f"{folder} is not a complete release: {', '.join(missing)} missing; {FIX}."
        )
    extra = sorted(present - set(recorded))
    if extra:
        raise ReleaseError(
            folder / extra[0],
            f"{folder} holds {', '.join(extra)}, which `featcal export` did not write (a push uploads every file "
            f"of the folder): remove {'it' if len(extra) == 1 else 'them'}, or {FIX}.",
        )


def _check_model_files(folder: Path) -> None:
    """The recipe is featcal's, of a family whose model folders are released on their own (a language model, a
    T5); the configuration is of that family and reads; each weight file's header parses and the index (when
    sharded) maps exactly the tensors the shards hold."""
    from featcal.families import family_names, get_family

    try:
        recipe = ModelRecipe.from_json(json.loads((folder / RECIPE_FILE).read_text(encoding="utf-8")), folder)
        if recipe.family not in family_names() or not releases_folders(recipe.family):
            raise ReleaseError(
                folder / RECIPE_FILE,
                f"{folder / RECIPE_FILE} is the recipe of a {recipe.family} model, whose folder is not released on "
                f"its own (only {' and '.join(folder_families())} models are).",
            )
        get_family(recipe.family).model_config(folder)
        weights, index = weight_files(folder, "Release")
    except ValueError as exc:  # JSONDecodeError
        raise ReleaseError(folder / RECIPE_FILE, f"{folder / RECIPE_FILE} is not valid JSON ({exc}); {FIX}.") from None
    except ModelInputError as exc:
        raise ReleaseError(exc.ref, f"{exc.message.rstrip('.')}; {FIX}.") from None
    headers = [read_header(folder / name) for name in weights]
    if index is not None:
        mapped = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
        held = {name: header.path.name for header in headers for name in header.tensors}
        wrong = sorted(name for name in set(mapped) | set(held) if mapped.get(name) != held.get(name))
        if wrong:
            raise ReleaseError(
                folder / index,
                f"{folder / index} does not map the tensors the shards hold ({', '.join(wrong[:3])}); {FIX}.",
            )


def _check_card(folder: Path) -> ModelCard:
    try:
        card = ModelCard.load(folder / CARD_FILE)
    except (ValueError, yaml.YAMLError) as exc:
        raise ReleaseError(
            folder, f"The model card {folder / CARD_FILE} has invalid metadata ({exc}); {FIX}."
        ) from None
    if not card.data.to_dict():
        raise ReleaseError(folder, f"The model card {folder / CARD_FILE} has no metadata header; {FIX}.")
    return card


def check_model_release(folder: str | Path) -> Release:
    """The release of a model folder in ``folder`` (a language model's or a T5's), or a ReleaseError naming what is
    wrong.

    Checks, cheapest first: the manifest reads; the folder holds exactly the files it lists (hidden files, which
    a push does not upload, aside); ``featcal_recipe.json`` is the recipe of a family whose folders are released
    on their own; ``config.json`` is of that family and read by transformers; every weight file the folder needs
    is there (each shard of the index) and its safetensors header parses, every tensor's bytes inside the file,
    and the index maps exactly the tensors the shards hold; the card's metadata parses; and every file has the
    SHA-256 the manifest records (which reads every byte once, as the upload will). The model is not loaded.

    Args:
        folder: The release folder (written by ``featcal export MODEL_FOLDER``).

    Returns:
        The checked release: its files as a push uploads them, the recipe hash and the card.

    Raises:
        ReleaseError: when a file is missing, unreadable, changed since export, or not part of the release.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ReleaseError(folder, f"Release folder {folder} does not exist: {FIX}.")
    manifest = read_manifest(folder)
    files = local_files(folder)
    _check_listing(folder, files, dict(manifest.files))
    _check_model_files(folder)
    card = _check_card(folder)
    for name, recorded in sorted(manifest.files.items()):
        actual = file_sha256(folder / name)
        if actual != recorded:
            card_hint = " (`featcal card MODEL_FOLDER` regenerates the card)" if name == CARD_FILE else ""
            raise ReleaseError(
                folder / name,
                f"{folder / name} differs from what `featcal export` wrote (sha256 {actual[:12]}, recorded "
                f"{recorded[:12]} in {MANIFEST}): restore it, or {FIX}{card_hint}.",
            )
    return Release(folder=folder, files=files, recipe_sha256=manifest.recipe_sha256, card=card)
