"""The one release check: a folder is a complete, self-consistent release before anything is uploaded.

Two kinds of release, told apart by their files (:func:`~featcal.release.model_folder.is_model_release`), share the
checks of the file listing, the card and every file's SHA-256 against ``release_manifest.json``:

- a run's own release (``run_config.json`` beside the weights): the weights' safetensors metadata names the recipe
  and the tensors' hash, the weights load as the family's class, and the metrics, recipe and weights name one run;
- a model folder's release (``featcal_recipe.json``, no ``run_config.json``: a model folder's, or a run released
  as its stage folder): checked without loading the model; an 8B model's configuration is read by transformers,
  each weight file's safetensors header parsed (every tensor's bytes inside the file, the shard index naming
  exactly the tensors the shards hold).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from featcal.errors import ModelInputError, ReleaseError
from featcal.families import DEFAULT_FAMILY, family_names, get_family
from featcal.files.model_files import WEIGHTS
from featcal.hub.verification import HubFile, local_files
from featcal.metrics import RUN_ID
from featcal.model_recipe import RECIPE_FILE, ModelRecipe
from featcal.release.card_template import CARD_FILE
from featcal.release.export import COMMON_FILES, load_released_model, required_files
from featcal.release.manifest import MANIFEST, file_sha256, read_manifest, tensors_sha256
from featcal.release.model_folder import folder_families, is_model_release, releases_folders, weight_files
from featcal.release.tensors import read_header
from featcal.runfolder.layout import METRICS, RUN_CONFIG
from featcal.runfolder.reader import read_json_file
from featcal.runfolder.record import recipe_sha256


@dataclass(frozen=True)
class _Words:
    """How a refusal tells the fix of one kind of release.

    Attributes:
        fix: How to rebuild the release.
        rebuild: The same, where a file is to be removed or restored first.
        card: The command that regenerates the card.
        at_first_missing: Whether a missing file's refusal names that file (else the folder).
    """

    fix: str
    rebuild: str
    card: str
    at_first_missing: bool


RUN = _Words(
    fix="rebuild it with `featcal export RUN_FOLDER`",
    rebuild="rebuild the release with `featcal export RUN_FOLDER`",
    card="`featcal card RUN_FOLDER`",
    at_first_missing=False,
)
FOLDER = _Words(
    fix="rebuild it with `featcal export MODEL_FOLDER`",
    rebuild="rebuild it with `featcal export MODEL_FOLDER`",
    card="`featcal card MODEL_FOLDER`",
    at_first_missing=True,
)


@dataclass(frozen=True)
class Release:
    """A checked release folder."""

    folder: Path
    files: tuple[HubFile, ...]
    recipe_sha256: str
    card: ModelCard

    @property
    def model_name(self) -> str | None:
        """The repository the card was rendered for (the name in its ``model-index``)."""
        return self.card.data.model_name


def _check_listing(folder: Path, files: tuple[HubFile, ...], recorded: dict[str, str], words: _Words) -> None:
    """The folder holds exactly the files of the manifest (hidden files, which a push skips, aside)."""
    present = {f.path_in_repo for f in files} - {MANIFEST}
    missing = sorted(set(recorded) - present)
    if missing:
        raise ReleaseError(
            folder / missing[0] if words.at_first_missing else folder,
            f"{folder} is not a complete release: {', '.join(missing)} missing; {words.fix}.",
        )
    extra = sorted(present - set(recorded))
    if extra:
        raise ReleaseError(
            folder / extra[0],
            f"{folder} holds {', '.join(extra)}, which `featcal export` did not write (a push uploads every file "
            f"of the folder): remove {'it' if len(extra) == 1 else 'them'}, or {words.rebuild}.",
        )


def _check_hashes(folder: Path, recorded: dict[str, str], words: _Words) -> None:
    """Every file has the SHA-256 the manifest records (which reads every byte once, as the upload will)."""
    for name, sha in sorted(recorded.items()):
        actual = file_sha256(folder / name)
        if actual != sha:
            card = f" ({words.card} regenerates the card)" if name == CARD_FILE else ""
            raise ReleaseError(
                folder / name,
                f"{folder / name} differs from what `featcal export` wrote (sha256 {actual[:12]}, recorded "
                f"{sha[:12]} in {MANIFEST}): restore it, or {words.rebuild}{card}.",
            )


def _check_card(folder: Path, words: _Words) -> ModelCard:
    """The card's metadata header parses and is not empty."""
    try:
        card = ModelCard.load(folder / CARD_FILE)
    except (ValueError, yaml.YAMLError) as exc:
        raise ReleaseError(
            folder, f"The model card {folder / CARD_FILE} has invalid metadata ({exc}); {words.fix}."
        ) from None
    if not card.data.to_dict():
        raise ReleaseError(folder, f"The model card {folder / CARD_FILE} has no metadata header; {words.fix}.")
    return card


def _weights_metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of the weights, which must name the recipe."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise ReleaseError(path, f"{path} is not a readable safetensors file ({exc}).") from None
    if not metadata.get("recipe_sha256"):
        raise ReleaseError(
            path, f"{path} carries no recipe_sha256 in its metadata: it was not written by `featcal export`."
        )
    return metadata


def _recorded(metadata: dict[str, str], key: str, path: Path) -> str:
    value = metadata.get(key)
    if not value:
        raise ReleaseError(
            path,
            f"{path} carries no {key} in its metadata: it was written by an older featcal or not by "
            f"`featcal export`; {RUN.fix}.",
        )
    return value


def _check_tensors(path: Path, metadata: dict[str, str]) -> str:
    """The weights' tensor data must hash to the ``tensors_sha256`` recorded at export."""
    recorded = _recorded(metadata, "tensors_sha256", path)
    actual = tensors_sha256(path)
    if actual != recorded:
        raise ReleaseError(
            path,
            f"{path}: its tensor data (sha256 {actual[:12]}) is not what `featcal export` wrote "
            f"(tensors_sha256 {recorded[:12]} in its metadata): the weights were changed after export; {RUN.fix}.",
        )
    return recorded


def check_release(folder: str | Path) -> Release:
    """The release in ``folder``, or a ReleaseError naming what is missing, inconsistent or changed.

    A model folder's release (:func:`~featcal.release.model_folder.is_model_release`) is checked without loading
    the model, cheapest first: the manifest reads; the folder holds exactly the files it lists;
    ``featcal_recipe.json`` is the recipe of a family whose folders are released on their own; ``config.json`` is
    of that family and read by transformers; every weight file is there (each shard of the index), its safetensors
    header parses, every tensor's bytes inside the file, and the index maps exactly the tensors the shards hold;
    the card's metadata parses; every file has the SHA-256 the manifest records.

    A run's own release: the card, metrics, recipe, weights, manifest and the family's preprocessor files are all
    there; the weights load as the family's class (a ``CLIPVisionModel``); the card's metadata parses;
    ``metrics.json`` (its ``run_id``), ``run_config.json`` (its ``run_id``) and the weights (``recipe_sha256``
    metadata) name the same run, and the recipe hash of ``run_config.json`` is the ``published_config_sha256``
    recorded in the weights; the tensor data hashes to the weights' ``tensors_sha256``; and the folder holds
    exactly the files of ``release_manifest.json``, each with the SHA-256 recorded there.

    Either way hidden files, which a push does not upload, are ignored.

    Args:
        folder: The release folder.

    Returns:
        The checked release: its files as a push uploads them, the recipe hash and the card.

    Raises:
        ReleaseError: when a file is missing, damaged, changed since export, or not part of the release.
        ModelInputError: when a run's release's weights do not load as the family's class.
    """
    folder = Path(folder).expanduser()
    if is_model_release(folder):
        return _check_folder_release(folder)
    if not folder.is_dir():
        raise ReleaseError(folder, f"Release folder {folder} does not exist: {RUN.fix}.")
    missing = [name for name in COMMON_FILES if not (folder / name).is_file()]
    if missing:
        raise ReleaseError(folder, f"{folder} is not a complete release: {', '.join(missing)} missing; {RUN.fix}.")
    config = read_json_file(folder / RUN_CONFIG, f"Release {folder}")
    family = get_family(config.get("family", DEFAULT_FAMILY) if isinstance(config, dict) else DEFAULT_FAMILY)
    missing = [name for name in required_files(family) if not (folder / name).is_file()]
    if missing:
        raise ReleaseError(folder, f"{folder} is not a complete release: {', '.join(missing)} missing; {RUN.fix}.")
    metadata = _weights_metadata(folder / WEIGHTS)
    recipe = metadata["recipe_sha256"]
    load_released_model(family, folder, f"Release {folder}")
    card = _check_card(folder, RUN)
    metrics = read_json_file(folder / METRICS, f"Release {folder}")
    if metrics.get("run_id") != recipe:
        raise ReleaseError(
            folder,
            f"{folder / METRICS} (run_id {metrics.get('run_id')}) does not describe the weights in "
            f"{folder / WEIGHTS} (recipe {recipe[:12]}); {RUN.fix}.",
        )
    run_id = config.get(RUN_ID) if isinstance(config, dict) else None
    if run_id != recipe:
        raise ReleaseError(
            folder / RUN_CONFIG,
            f"{folder / RUN_CONFIG} is not the recipe of the weights in {folder / WEIGHTS} "
            f"(run_id {str(run_id)[:12]} vs recipe {recipe[:12]}); {RUN.fix}.",
        )
    published = _recorded(metadata, "published_config_sha256", folder / WEIGHTS)
    if recipe_sha256(config) != published:
        raise ReleaseError(
            folder / RUN_CONFIG,
            f"{folder / RUN_CONFIG} is not the recipe of the weights in {folder / WEIGHTS} "
            f"(hash {recipe_sha256(config)[:12]} vs {published[:12]} recorded at export); {RUN.fix}.",
        )
    tensors = _check_tensors(folder / WEIGHTS, metadata)
    files = local_files(folder)
    manifest = read_manifest(folder)
    where = folder / MANIFEST
    if manifest.recipe_sha256 != recipe or manifest.tensors_sha256 != tensors:
        raise ReleaseError(
            where,
            f"{where} describes other weights (recipe {manifest.recipe_sha256[:12]}, tensors "
            f"{manifest.tensors_sha256[:12]}) than {folder / WEIGHTS} (recipe {recipe[:12]}, tensors "
            f"{tensors[:12]}); {RUN.fix}.",
        )
    _check_listing(folder, files, dict(manifest.files), RUN)
    _check_hashes(folder, dict(manifest.files), RUN)
    return Release(folder=folder, files=files, recipe_sha256=recipe, card=card)


def _check_folder_release(folder: Path) -> Release:
    """A model folder's release, checked without loading the model (see :func:`check_release`)."""
    manifest = read_manifest(folder)
    files = local_files(folder)
    _check_listing(folder, files, dict(manifest.files), FOLDER)
    _check_model_files(folder)
    card = _check_card(folder, FOLDER)
    _check_hashes(folder, dict(manifest.files), FOLDER)
    return Release(folder=folder, files=files, recipe_sha256=manifest.recipe_sha256, card=card)


def _check_model_files(folder: Path) -> None:
    """The recipe is featcal's, of a family whose model folders are released on their own (a language model, a
    T5); the configuration is of that family and reads; each weight file's header parses and the index (when
    sharded) maps exactly the tensors the shards hold."""
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
        raise ReleaseError(
            folder / RECIPE_FILE, f"{folder / RECIPE_FILE} is not valid JSON ({exc}); {FOLDER.fix}."
        ) from None
    except ModelInputError as exc:
        raise ReleaseError(exc.ref, f"{exc.message.rstrip('.')}; {FOLDER.fix}.") from None
    headers = [read_header(folder / name) for name in weights]
    if index is not None:
        mapped = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
        held = {name: header.path.name for header in headers for name in header.tensors}
        wrong = sorted(name for name in set(mapped) | set(held) if mapped.get(name) != held.get(name))
        if wrong:
            raise ReleaseError(
                folder / index,
                f"{folder / index} does not map the tensors the shards hold ({', '.join(wrong[:3])}); {FOLDER.fix}.",
            )
