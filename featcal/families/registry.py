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
TASK_SCHEMAS = ("image", "text", "pair")  # the kinds of task entry a family reads (ModelFamily.task_schema)
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
        return TASK_SCHEMAS[0]
    return str(getattr(lookup(name), "task_schema", TASK_SCHEMAS[0]))


def family_of_schema(schema: str) -> str:
    """The built-in family whose tasks are entries of ``schema`` (a data file's family when it names none).

    Raises:
        ValueError: for a schema no built-in family reads.
    """
    for name in BUILTIN:
        if task_schema(name) == schema:
            return name
    raise ValueError(f"no built-in model family reads {schema!r} task entries")


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
