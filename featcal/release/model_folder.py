"""A model folder written by featcal, as a release reads it: its recipe and its files.

``featcal merge`` and ``featcal calibrate`` write a model folder (:mod:`featcal.model_recipe`): the
weights (one ``model.safetensors``, or shards and ``model.safetensors.index.json``), ``config.json``,
the base's tokenizer files and generation config, and ``featcal_recipe.json``. This module tells such
a folder from a run folder and a release, checks it holds what a release needs, without loading the
model, and lists its files. A folder is released on its own for the families whose
:class:`~featcal.families.base.ReleaseParts` name a ``folder_card_template`` (language models, T5s); a CLIP
stage folder is released from the run that made it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal.errors import ModelInputError
from featcal.families import family_names, get_family
from featcal.files.hashing import config_hash
from featcal.files.model_files import COMPANION_FILES, MODEL_CONFIG, WEIGHTS, WEIGHTS_INDEX
from featcal.files.reading import check_model_text_files
from featcal.model_recipe import RECIPE_FILE, ModelRecipe
from featcal.release.manifest import MANIFEST
from featcal.runfolder.layout import RUN_CONFIG


def folder_families() -> list[str]:
    """The families whose model folders are released on their own: those with a folder card template."""
    return [name for name in family_names() if get_family(name).release.folder_card_template is not None]


def releases_folders(family: str) -> bool:
    """Whether a model folder of ``family`` (a registered family's name) is released on its own."""
    return get_family(family).release.folder_card_template is not None


def folder_companions(family: str) -> tuple[str, ...]:
    """The files besides the weights and ``config.json`` that a model folder of ``family`` may hold and its
    release carries: the tokenizer files and generation config (:data:`COMPANION_FILES`), and the files the
    family's run releases hold from the base (a T5's ``spiece.model``)."""
    parts = get_family(family).release
    return tuple(dict.fromkeys((*COMPANION_FILES, *parts.files, *parts.optional_files)))


def is_model_folder(path: str | Path) -> bool:
    """Whether ``path`` is a model folder featcal wrote (its ``featcal_recipe.json``), not a run folder nor a
    release.

    Args:
        path: A folder given to ``featcal export``, ``card`` or ``push``.

    Returns:
        True for a folder with ``featcal_recipe.json`` and neither ``run_config.json`` nor a release manifest.
    """
    path = Path(path).expanduser()
    return (path / RECIPE_FILE).is_file() and not (path / RUN_CONFIG).is_file() and not (path / MANIFEST).is_file()


def is_model_input(path: str | Path) -> bool:
    """Whether ``featcal export`` and ``featcal card`` read ``path`` as a model folder rather than a run folder:
    it has no ``run_config.json`` but a ``featcal_recipe.json`` or a ``config.json`` (a model folder without
    featcal's recipe is then refused as such, and nothing is written into it).

    Args:
        path: The folder given to ``featcal export`` or ``featcal card``.

    Returns:
        True for a folder to read with :func:`read_model_folder`.
    """
    path = Path(path).expanduser()
    return not (path / RUN_CONFIG).is_file() and ((path / RECIPE_FILE).is_file() or (path / MODEL_CONFIG).is_file())


def is_model_release(path: str | Path) -> bool:
    """Whether ``path`` is (or claims to be) the release of a model folder: a release manifest beside a
    ``featcal_recipe.json``, where a run's release has ``run_config.json``.

    Args:
        path: A folder given to ``featcal push`` or ``card``.

    Returns:
        True when the folder holds ``release_manifest.json`` and ``featcal_recipe.json`` and no ``run_config.json``.
    """
    path = Path(path).expanduser()
    return (path / MANIFEST).is_file() and (path / RECIPE_FILE).is_file() and not (path / RUN_CONFIG).is_file()


def default_release_folder(model_dir: str | Path) -> Path:
    """Where a model folder's release goes by default: the sibling ``<folder>-release``.

    Args:
        model_dir: The model folder.

    Returns:
        ``<parent>/<folder name>-release`` (beside the folder, never inside it).
    """
    path = Path(model_dir).expanduser().absolute()
    return path.parent / f"{path.name}-release"


@dataclass(frozen=True)
class ModelFolder:
    """A checked model folder of featcal's (a language model's or a T5's).

    Attributes:
        path: The folder.
        recipe: Its ``featcal_recipe.json``.
        raw_recipe: That file's contents as read.
        weights: The names of its weight files (``model.safetensors``, or the shards), sorted.
        index: ``model.safetensors.index.json`` when the weights are sharded, else None.
        companions: The tokenizer files and generation config it holds (:func:`folder_companions`).
        architecture: The model's class as ``config.json`` names it (``LlamaForCausalLM``), else its model type.
    """

    path: Path
    recipe: ModelRecipe
    raw_recipe: dict[str, Any]
    weights: tuple[str, ...]
    index: str | None
    companions: tuple[str, ...]
    architecture: str = ""

    @property
    def recipe_sha256(self) -> str:
        """The recipe's hash: the SHA-256 of ``featcal_recipe.json``'s contents, keys sorted (the hash
        featcal gives a run's recipe, :func:`featcal.files.hashing.config_hash`)."""
        return config_hash(self.raw_recipe)

    @property
    def family(self) -> str:
        """The model's family, as the recipe names it (``causal_lm``, ``seq2seq``)."""
        return self.recipe.family

    @property
    def calibrated(self) -> bool:
        """Whether the folder holds a calibrated model (else a merge)."""
        return self.recipe.featcal is not None


def weight_files(folder: Path, what: str) -> tuple[tuple[str, ...], str | None]:
    """The weight files of a model folder: ``model.safetensors``, or the shards its index lists.

    Args:
        folder: The folder.
        what: What the folder is, for messages (``"Model folder"``, ``"Release"``).

    Returns:
        The weight files' names, sorted, and the index's name (None for one file).

    Raises:
        ModelInputError: when the folder has neither, the index is not JSON with a ``weight_map``, or a
            shard it lists is missing (each named).
    """
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        if not (folder / WEIGHTS).is_file():
            raise ModelInputError(
                str(folder), f"{what} {folder} holds no weights ({WEIGHTS}, or shards and {WEIGHTS_INDEX})."
            )
        return (WEIGHTS,), None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelInputError(str(index), f"{index} is not a shard index with a weight_map ({exc}).") from None
    if not names or any("/" in name or name.startswith(".") for name in names):
        raise ModelInputError(str(index), f"{index} names no shard, or a shard outside its folder.")
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise ModelInputError(
            str(folder / missing[0]),
            f"{what} {folder} lacks the shard(s) {', '.join(missing)} that {WEIGHTS_INDEX} lists: the weights are "
            "incomplete; write the folder again.",
        )
    return tuple(names), WEIGHTS_INDEX


def read_model_folder(folder: str | Path) -> ModelFolder:
    """The model folder ``folder``, checked without loading the model.

    Args:
        folder: A folder written by ``featcal merge`` or ``featcal calibrate`` (``featcal_recipe.json``
            naming a family whose folders are released on their own: :func:`folder_families`).

    Returns:
        The folder, its recipe and its files.

    Raises:
        ModelInputError: when the folder does not exist, is a release, has no (or a damaged)
            ``featcal_recipe.json``, is a model of another family (a CLIP stage folder: its run folder is
            released), has no readable ``config.json``, or lacks weights (a shard of its index included).
        InputError: for a configuration, tokenizer or recipe file that is not UTF-8 text.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelInputError(str(folder), f"Model folder {folder} does not exist.")
    if (path / MANIFEST).is_file():
        raise ModelInputError(
            str(folder),
            f"{path} is a release already (it has {MANIFEST}): push it with `featcal push`, or export the model "
            "folder it was made from.",
        )
    check_model_text_files(path)
    recipe_path = path / RECIPE_FILE
    if not recipe_path.is_file():
        raise ModelInputError(
            str(folder),
            f"{path} has no {RECIPE_FILE}: `featcal export` releases a run folder (with {RUN_CONFIG}) or a model "
            "folder written by `featcal merge` or `featcal calibrate`.",
        )
    try:
        raw = json.loads(recipe_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelInputError(str(recipe_path), f"{recipe_path} is not readable JSON ({exc}).") from None
    recipe = ModelRecipe.from_json(raw, recipe_path)
    if recipe.family not in family_names() or not releases_folders(recipe.family):
        raise ModelInputError(
            str(folder),
            f"{path} holds a {recipe.family} model: such a model is released from the run folder that made it "
            f"(`featcal export RUN`); a model folder is released on its own only for {' and '.join(folder_families())} "
            "models.",
        )
    try:
        config = json.loads((path / MODEL_CONFIG).read_text(encoding="utf-8"))
        if not isinstance(config, dict) or not config.get("model_type"):
            raise ValueError("no model_type")
    except (OSError, ValueError) as exc:
        raise ModelInputError(str(path / MODEL_CONFIG), f"{path / MODEL_CONFIG} is not readable ({exc}).") from None
    weights, index = weight_files(path, "Model folder")
    companions = tuple(name for name in folder_companions(recipe.family) if (path / name).is_file())
    architecture = str((config.get("architectures") or [config["model_type"]])[0])
    return ModelFolder(path, recipe, raw, weights, index, companions, architecture)
