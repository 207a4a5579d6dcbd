"""Model families: one package each, the only place that knows its models (see :mod:`featcal.families.base`).

A family is looked up by the name a run records (``clip_vision``), or by the ``model_type`` of a
model or folder. Family modules are imported on first use, so listing commands import no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import ModelInputError
from featcal.families.registry import (
    BUILTIN,
    DEFAULT_FAMILY,
    IMAGE_SCHEMA,
    REGISTERED,
    TASK_SCHEMAS,
    command_modules,
    data_file_defaults,
    data_file_family,
    data_file_keys,
    family_names,
    lookup,
    mergekit_family,
    mergekit_reader,
    task_entry_reader,
    task_schema,
)
from featcal.files.model_files import MODEL_CONFIG

__all__ = [
    "BUILTIN",
    "DEFAULT_FAMILY",
    "IMAGE_SCHEMA",
    "TASK_SCHEMAS",
    "adapter_for",
    "command_modules",
    "data_file_defaults",
    "data_file_family",
    "data_file_keys",
    "family_names",
    "family_of_folder",
    "family_of_type",
    "get_family",
    "mergekit_family",
    "mergekit_reader",
    "register_family",
    "task_entry_reader",
    "task_schema",
    "tasks_hint",
    "unregister_family",
]

if TYPE_CHECKING:
    from torch import nn

    from featcal.calibration.adapters import LayerAdapter
    from featcal.families.base import ModelFamily


def register_family(family: ModelFamily) -> None:
    """Make ``family`` known by its name (a family of a plugin or a test); a ValueError if the name is taken."""
    if family.name in BUILTIN or family.name in REGISTERED:
        raise ValueError(f"model family {family.name!r} registered twice")
    REGISTERED[family.name] = family


def unregister_family(name: str) -> None:
    """Forget a family added with :func:`register_family` (built-in ones stay)."""
    REGISTERED.pop(name, None)


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name``.

    Raises:
        UnknownNameError: naming the known families.
    """
    family: ModelFamily = lookup(name)
    return family


def tasks_hint(family: ModelFamily) -> str:
    """How to give ``family``'s tasks to ``featcal evaluate`` (:attr:`ModelFamily.tasks_hint`; a family that
    declares none: ``tasks of family NAME``)."""
    return getattr(family, "tasks_hint", None) or f"tasks of family {family.name}"


def family_of_type(model_type: Any, where: str | Path) -> ModelFamily:
    """The family whose models have ``model_type`` (a ``config.json``'s).

    Raises:
        ModelInputError: naming ``where`` and the model types featcal knows.
    """
    for name in family_names():
        family = get_family(name)
        if model_type in family.model_types:
            return family
    known = sorted(t for name in family_names() for t in get_family(name).model_types)
    raise ModelInputError(
        str(where),
        f"{where} holds a {model_type!r} model, of no model family featcal knows ({', '.join(family_names())}: "
        f"model types {', '.join(known)}).",
    )


def family_of_folder(folder: str | Path) -> ModelFamily:
    """The family of the model in ``folder``, by its ``config.json``'s ``model_type``.

    Raises:
        ModelInputError: for a folder without a readable ``config.json``, or of no known family.
    """
    config = Path(folder) / MODEL_CONFIG
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ModelInputError(str(folder), f"{folder} has no readable config.json: is it a model folder?") from None
    return family_of_type(model_type, folder)


def adapter_for(model: nn.Module) -> LayerAdapter:
    """The calibration adapter of ``model``'s family, by its configuration's ``model_type``.

    Raises:
        ModelInputError: for a model of no known family.
    """
    config = getattr(model, "config", None)
    return family_of_type(getattr(config, "model_type", None), type(model).__name__).adapter()
