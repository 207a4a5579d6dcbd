"""YAML recipes: a run's options in a reviewable file (`featcal run --recipe FILE`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from featcal.errors import FeatcalError


def load_recipe(path: str | Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's values keyed by option destination; unknown keys are an error naming them.

    Keys are option names without the leading dashes (``merge-method`` or ``merge_method``).
    ``merge-param`` may be a mapping (``{iter_num: 400}``) instead of a list of ``KEY=VALUE``.
    """
    path = Path(path)
    if not path.is_file():
        raise FeatcalError(f"Recipe {path} does not exist.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise FeatcalError(f"Recipe {path} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise FeatcalError(f"Recipe {path}: expected a mapping of option names to values.")
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        if key not in options:
            raise FeatcalError(f"Recipe {path}: unknown option {raw_key!r}; use the names of `featcal run --help`.")
        if key == "merge_param" and isinstance(value, Mapping):
            value = [
                f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in value.items()
            ]
        if key == "tasks" and isinstance(value, str):
            value = [value]
        values[key] = value
    return values
