"""Reading the files a user names: text (a recipe, a tasks file, a card template) and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from featcal.errors import InputError


def read_text_input(path: Path, what: str) -> str:
    """The UTF-8 text of an input file the user named (a recipe, a tasks file, a card template).

    Args:
        path: The file.
        what: What it is, for messages (``"Recipe"``).

    Raises:
        InputError: for a missing file, a folder, a file that is not UTF-8 text or cannot be read.
    """
    if path.is_dir():
        raise InputError(path, f"{what} {path} is a folder, not a file.")
    if not path.is_file():
        raise InputError(path, f"{what} {path} does not exist.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(path, f"{what} {path} is not UTF-8 text: save it as UTF-8.") from None
    except OSError as exc:
        raise InputError(path, f"{what} {path} cannot be read ({exc.strerror or exc}).") from None


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
