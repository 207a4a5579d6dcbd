"""The registry's store: which model families exist, where each lives, and the facts generic modules ask of one.

This module imports no family and none of the interface's types (:mod:`featcal.families.base`), so the modules
those types name (the task table, the suites, the run record) may ask it without an import cycle;
:mod:`featcal.families` is the typed face of the same store. Family modules are imported on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from featcal.errors import UnknownNameError

# Built-in families: name -> the module whose ``FAMILY`` attribute is the family.
BUILTIN = {
    "clip_vision": "featcal.families.clip_vision",
    "causal_lm": "featcal.families.causal_lm",
    "seq2seq": "featcal.families.seq2seq",
}
DEFAULT_FAMILY = "clip_vision"  # the family of a task, suite, run record or release whose entry names none
IMAGE_SCHEMA = "image"  # the default family's kind of task: classes and zero-shot templates, no calibration texts
TASK_SCHEMAS = (IMAGE_SCHEMA, "text", "pair")  # the built-in families' kinds of task (ModelFamily.task_schema)
REGISTERED: dict[str, Any] = {}  # families added by a plugin or a test (featcal.families.register_family)


def family_names() -> list[str]:
    """Every known family's name, sorted."""
    return sorted({*BUILTIN, *REGISTERED})


def lookup(name: str) -> Any:
    """The family registered as ``name`` (typed as :class:`~featcal.families.base.ModelFamily` by
    :func:`featcal.families.get_family`).

    Raises:
        UnknownNameError: naming the known families.
    """
    if name in REGISTERED:
        return REGISTERED[name]
    if name not in BUILTIN:
        raise UnknownNameError("model family", name, family_names())
    return import_module(BUILTIN[name]).FAMILY


def task_schema(name: str) -> str:
    """Which kind of task entry the family ``name`` reads (``ModelFamily.task_schema``): ``image`` (class
    names and prompt templates), ``text`` (a :class:`~featcal.tasks.TextFormat`) or ``pair`` (a
    :class:`~featcal.tasks.TextPairFormat`). A family that declares none, or a name of no known family, reads
    ``image`` entries (the default family's).
    """
    if name not in family_names():
        return IMAGE_SCHEMA
    return str(getattr(lookup(name), "task_schema", IMAGE_SCHEMA))


def task_entry_reader(name: str) -> Any:
    """The family that reads the task entries of family ``name`` (``ModelFamily.task_fields`` and
    ``parse_task_fields``): that family, or the default family's for a family that declares none or a name of no
    known family (whose entries are ``image`` entries, as :func:`task_schema` says)."""
    if name in family_names():
        family = lookup(name)
        if getattr(family, "parse_task_fields", None) is not None:
            return family
    return lookup(DEFAULT_FAMILY)


def _data_file_readers() -> list[tuple[str, Any]]:
    """``(name, DataFileEntries)`` of every family a data file describes (``ModelFamily.data_file``), the
    built-in ones first."""
    names = [*BUILTIN, *(name for name in REGISTERED if name not in BUILTIN)]
    entries = ((name, getattr(lookup(name), "data_file", None)) for name in names)
    return [(name, entry) for name, entry in entries if entry is not None]


def data_file_family(entry: Any) -> str:
    """The family of a data file's expert ``entry`` when the file names none: the family whose ``marks`` the
    entry gives (a key not None), else the one whose entries carry no mark.

    Raises:
        ValueError: when no family reads data files.
    """
    readers = _data_file_readers()
    for name, reader in readers:
        if any(entry.get(key) is not None for key in reader.marks):
            return name
    for name, reader in readers:
        if not reader.marks:
            return name
    raise ValueError("no model family reads calibration data files")


def data_file_keys() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The keys a data file's expert entry may give for some family (``keys``, then ``defaults``), each once, in
    the families' order."""
    readers = _data_file_readers()
    keys = dict.fromkeys(key for _, reader in readers for key in reader.keys)
    defaults = dict.fromkeys(key for _, reader in readers for key in reader.defaults)
    return tuple(keys), tuple(defaults)


def data_file_defaults(name: str) -> tuple[str, ...]:
    """The keys of a data file's top level that the entries of family ``name`` inherit (``DataFileEntries.defaults``);
    a family that a data file does not describe, or no known family, inherits those of the family that reads
    unmarked entries."""
    readers = dict(_data_file_readers())
    if name in readers:
        return readers[name].defaults
    return readers[data_file_family({})].defaults


def run_option_classes() -> list[tuple[str, type]]:
    """``(name, options class)`` of every built-in family that declares run options of its own
    (``ModelFamily.run_options``: a dataclass of :func:`featcal.options.option` fields, whose flags ``featcal run``
    offers), in the registry's order."""
    classes = ((name, getattr(lookup(name), "run_options", None)) for name in BUILTIN)
    return [(name, cls) for name, cls in classes if cls is not None]


def command_modules() -> list[str]:
    """The modules of the families' own CLI commands (``ModelFamily.command_module``; each has
    ``register(subparsers)``), by family name."""
    modules = (getattr(lookup(name), "command_module", None) for name in family_names())
    return [module for module in modules if module is not None]


def mergekit_family() -> str:
    """The built-in family whose merges mergekit makes (the one declaring ``ModelFamily.mergekit_module``): the
    family of a folder that only mergekit's ``mergekit_config.yml`` describes.

    Raises:
        ValueError: when no built-in family reads mergekit's files.
    """
    for name in BUILTIN:
        if getattr(lookup(name), "mergekit_module", None) is not None:
            return name
    raise ValueError("no built-in model family reads mergekit's files")


def mergekit_reader() -> Any:
    """The module that reads mergekit's files (``read_mergekit_folder``, ``parse_mergekit_config``): that of
    :func:`mergekit_family`, imported on first use.

    Raises:
        ValueError: when no built-in family reads mergekit's files.
    """
    return import_module(lookup(mergekit_family()).mergekit_module)
