"""Check that a folder is a complete, self-consistent release before anything is uploaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from featcal.errors import ReleaseError
from featcal.families import DEFAULT_FAMILY, get_family
from featcal.files.model_files import WEIGHTS
from featcal.hub.verification import HubFile, local_files
from featcal.metrics import RUN_ID
from featcal.release.card import CARD_FILE
from featcal.release.export import COMMON_FILES, load_released_model, required_files
from featcal.release.manifest import MANIFEST, file_sha256, read_manifest, tensors_sha256
from featcal.runfolder.layout import METRICS, RUN_CONFIG
from featcal.runfolder.reader import read_json_file
from featcal.runfolder.record import recipe_sha256

FIX = "rebuild it with `featcal export RUN_FOLDER`"
REBUILD = "rebuild the release with `featcal export RUN_FOLDER`"


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
            f"`featcal export`; {FIX}.",
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
            f"(tensors_sha256 {recorded[:12]} in its metadata): the weights were changed after export; {FIX}.",
        )
    return recorded


def _check_files(folder: Path, files: tuple[HubFile, ...], recipe: str, tensors: str) -> None:
    """Every file is listed in the manifest with the hash it has now, and nothing else is there."""
    manifest = read_manifest(folder)
    where = folder / MANIFEST
    if manifest.recipe_sha256 != recipe or manifest.tensors_sha256 != tensors:
        raise ReleaseError(
            where,
            f"{where} describes other weights (recipe {manifest.recipe_sha256[:12]}, tensors "
            f"{manifest.tensors_sha256[:12]}) than {folder / WEIGHTS} (recipe {recipe[:12]}, tensors "
            f"{tensors[:12]}); {FIX}.",
        )
    present = {f.path_in_repo for f in files} - {MANIFEST}
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise ReleaseError(folder, f"{folder} is not a complete release: {', '.join(missing)} missing; {FIX}.")
    extra = sorted(present - set(manifest.files))
    if extra:
        raise ReleaseError(
            folder / extra[0],
            f"{folder} holds {', '.join(extra)}, which `featcal export` did not write (a push uploads every "
            f"file of the folder): remove {'it' if len(extra) == 1 else 'them'}, or {REBUILD}.",
        )
    for name, recorded in sorted(manifest.files.items()):
        actual = file_sha256(folder / name)
        if actual != recorded:
            card = " (`featcal card RUN_FOLDER` regenerates the card)" if name == CARD_FILE else ""
            raise ReleaseError(
                folder / name,
                f"{folder / name} differs from what `featcal export` wrote (sha256 {actual[:12]}, recorded "
                f"{recorded[:12]} in {MANIFEST}): restore it, or {REBUILD}{card}.",
            )


def check_release(folder: str | Path) -> Release:
    """The release in ``folder``, or a ReleaseError naming what is missing, inconsistent or changed.

    Checks that the card, metrics, recipe, weights, manifest and the family's preprocessor files are all there; that
    the weights load as the family's class (a ``CLIPVisionModel``); that the card's metadata parses; that
    ``metrics.json`` (its ``run_id``), ``run_config.json`` (its ``run_id``) and the weights (``recipe_sha256``
    metadata) name the same run, and that the recipe hash of ``run_config.json`` is the ``published_config_sha256``
    recorded in the weights; that the tensor data hashes to the weights' ``tensors_sha256``; and that the folder
    holds exactly the files of ``release_manifest.json``, each with the SHA-256 recorded there (hidden files, which
    a push does not upload, are ignored).

    Args:
        folder: The release folder.

    Returns:
        The checked release: its files as a push uploads them, the recipe hash and the card.

    Raises:
        ReleaseError: when a file is missing, damaged, changed since export, or not part of the release.
        ModelInputError: when the weights do not load as the family's class.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ReleaseError(folder, f"Release folder {folder} does not exist: {FIX}.")
    missing = [name for name in COMMON_FILES if not (folder / name).is_file()]
    if missing:
        raise ReleaseError(folder, f"{folder} is not a complete release: {', '.join(missing)} missing; {FIX}.")
    config = read_json_file(folder / RUN_CONFIG, f"Release {folder}")
    family = get_family(config.get("family", DEFAULT_FAMILY) if isinstance(config, dict) else DEFAULT_FAMILY)
    missing = [name for name in required_files(family) if not (folder / name).is_file()]
    if missing:
        raise ReleaseError(folder, f"{folder} is not a complete release: {', '.join(missing)} missing; {FIX}.")
    metadata = _weights_metadata(folder / WEIGHTS)
    recipe = metadata["recipe_sha256"]
    load_released_model(family, folder, f"Release {folder}")
    try:
        card = ModelCard.load(folder / CARD_FILE)
    except (ValueError, yaml.YAMLError) as exc:
        raise ReleaseError(
            folder, f"The model card {folder / CARD_FILE} has invalid metadata ({exc}); {FIX}."
        ) from None
    if not card.data.to_dict():
        raise ReleaseError(folder, f"The model card {folder / CARD_FILE} has no metadata header; {FIX}.")
    metrics = read_json_file(folder / METRICS, f"Release {folder}")
    if metrics.get("run_id") != recipe:
        raise ReleaseError(
            folder,
            f"{folder / METRICS} (run_id {metrics.get('run_id')}) does not describe the weights in "
            f"{folder / WEIGHTS} (recipe {recipe[:12]}); {FIX}.",
        )
    run_id = config.get(RUN_ID) if isinstance(config, dict) else None
    if run_id != recipe:
        raise ReleaseError(
            folder / RUN_CONFIG,
            f"{folder / RUN_CONFIG} is not the recipe of the weights in {folder / WEIGHTS} "
            f"(run_id {str(run_id)[:12]} vs recipe {recipe[:12]}); {FIX}.",
        )
    published = _recorded(metadata, "published_config_sha256", folder / WEIGHTS)
    if recipe_sha256(config) != published:
        raise ReleaseError(
            folder / RUN_CONFIG,
            f"{folder / RUN_CONFIG} is not the recipe of the weights in {folder / WEIGHTS} "
            f"(hash {recipe_sha256(config)[:12]} vs {published[:12]} recorded at export); {FIX}.",
        )
    tensors = _check_tensors(folder / WEIGHTS, metadata)
    files = local_files(folder)
    _check_files(folder, files, recipe, tensors)
    return Release(folder=folder, files=files, recipe_sha256=recipe, card=card)
