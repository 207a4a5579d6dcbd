"""Reading the files a user names: text (a recipe, a tasks file, a card template) and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from featcal.errors import InputError
from featcal.files.model_files import MODEL_TEXT_FILES


def utf8_fault(path: Path) -> tuple[int, int] | None:
    """Where a file stops being UTF-8: the line (from 1) and the first byte that does not decode; None for
    a file that is UTF-8 text throughout. Read line by line, so a large file costs no memory.

    Raises:
        OSError: when the file cannot be read.
    """
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):  # b"\n" is never part of a multi-byte UTF-8 character
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, line[exc.start]
    return None


def _not_utf8(path: Path, what: str, fault: tuple[int, int]) -> InputError:
    line, byte = fault
    return InputError(path, f"{what} {path} is not UTF-8 text (line {line}: byte 0x{byte:02x}): save it as UTF-8.")


def check_utf8(path: Path, what: str) -> None:
    """Refuse a text file featcal (or a library it calls) reads that is not UTF-8, naming its line.

    Args:
        path: The file (one that does not exist is left to its reader).
        what: What it is, for messages (``"Task 'math': dataset file"``).

    Raises:
        InputError: naming the file, the line and the byte.
    """
    if not path.is_file():
        return
    try:
        fault = utf8_fault(path)
    except OSError as exc:
        raise InputError(path, f"{what} {path} cannot be read ({exc.strerror or exc}).") from None
    if fault is not None:
        raise _not_utf8(path, what, fault)


def check_model_text_files(folder: Path) -> None:
    """Refuse a model folder whose configuration, tokenizer or recipe files are not UTF-8 text.

    Raises:
        InputError: naming the file, the line and the byte.
    """
    for name in MODEL_TEXT_FILES:
        check_utf8(folder / name, "Model file")


def read_text_input(path: Path, what: str) -> str:
    """The UTF-8 text of an input file the user named (a recipe, a tasks file, a card template).

    Args:
        path: The file.
        what: What it is, for messages (``"Recipe"``).

    Raises:
        InputError: for a missing file, a folder, a file that is not UTF-8 text (naming the line) or cannot
            be read.
    """
    if path.is_dir():
        raise InputError(path, f"{what} {path} is a folder, not a file.")
    if not path.is_file():
        raise InputError(path, f"{what} {path} does not exist.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _not_utf8(path, what, utf8_fault(path) or (0, 0)) from None
    except OSError as exc:
        raise InputError(path, f"{what} {path} cannot be read ({exc.strerror or exc}).") from None


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


class DuplicateKeyError(ValueError):
    """A mapping in a JSON or YAML file names one key twice."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (``json``'s ``object_pairs_hook``)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(f"key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def unique_key_yaml_loader():
    """A safe YAML loader that refuses a mapping naming one key twice (PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line})")
                seen[key] = line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read_structured(path: Path, what: str) -> Any:
    """A JSON (``.json``) or YAML file the user named, parsed, with no key given twice in one mapping.

    Args:
        path: The file.
        what: What it is, for messages (``"Recipe"``, ``"Tasks file"``).

    Returns:
        The parsed data (None for an empty YAML file).

    Raises:
        InputError: for a file :func:`read_text_input` refuses, invalid JSON or YAML, or a repeated key
            (which a parser would otherwise resolve silently, keeping one of the values).
    """
    import yaml

    text = read_text_input(path, what)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        if kind == "JSON":
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=unique_key_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise InputError(path, f"{what} {path}: {exc}; keep one.") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(path, f"{what} {path} is not valid {kind}: {' '.join(str(exc).split())}") from None
