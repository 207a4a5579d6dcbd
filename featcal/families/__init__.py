"""Model families: one package each, the only place that knows its models (see :mod:`featcal.families.base`).

A family is looked up by the name a run records (``clip_vision``), or by the ``model_type`` of a
model or folder. Family modules are imported on first use, so listing commands import no torch.
"""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import ModelInputError, UnknownNameError
from featcal.files.model_files import MODEL_CONFIG

if TYPE_CHECKING:
    from torch import nn

    from featcal.calibration.adapters import LayerAdapter
    from featcal.families.base import ModelFamily

# Built-in families: name -> the module whose ``FAMILY`` attribute is the family.
BUILTIN = {
    "clip_vision": "featcal.families.clip_vision",
    "causal_lm": "featcal.families.causal_lm",
    "seq2seq": "featcal.families.seq2seq",
}
DEFAULT_FAMILY = "clip_vision"
_registered: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    """Make ``family`` known by its name (a family of a plugin or a test); a ValueError if the name is taken."""
    if family.name in BUILTIN or family.name in _registered:
        raise ValueError(f"model family {family.name!r} registered twice")
    _registered[family.name] = family


def unregister_family(name: str) -> None:
    """Forget a family added with :func:`register_family` (built-in ones stay)."""
    _registered.pop(name, None)


def family_names() -> list[str]:
    """Every known family's name, sorted."""
    return sorted({*BUILTIN, *_registered})


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name``.

    Raises:
        UnknownNameError: naming the known families.
    """
    if name in _registered:
        return _registered[name]
    if name not in BUILTIN:
        raise UnknownNameError("model family", name, family_names())
    return import_module(BUILTIN[name]).FAMILY


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
