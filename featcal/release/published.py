"""What a release publishes about its inputs: Hub ids as they are, local folders by name only.

A run made from local folders records their full paths in the run folder's ``run_config.json``
(export and the Space need them to find the base's image processor). A release goes to the Hub, so
its copy names every local input by its folder name, marked local: ``"local:<folder name>"``, e.g.
``"/home/me/models/clip-tiny"`` becomes ``"local:clip-tiny"``. That form keeps every value a
string, is not a valid Hub id (``:`` is not allowed in one) and does not name an existing path, so
no tool mistakes it for either.

The published ``run_config.json`` keeps its ``run_id``: the recipe hash of the run it comes from
(``recipe_sha256`` in the weights, ``run_id`` in ``metrics.json``). Its own recipe hash
(:func:`featcal.runfolder.recipe_sha256` of the published copy) is recorded at export in the weights'
metadata as ``published_config_sha256``; it equals ``run_id`` when no input was local.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from featcal.families.registry import DEFAULT_FAMILY, task_entry_reader
from featcal.hub.refs import is_hub_id

LOCAL_MARK = "local:"
# Values that look like an absolute path on some system: /x, ~, ~user, C:\x or C:/x, \\server\x.
_ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:[\\/]|\\\\)")


@cache
def _prose_keys() -> frozenset[str]:
    """The task-entry keys whose lists are prose, not references, and never rewritten: an image entry's own fields
    (the default family's ``task_fields``: its class names and prompt templates)."""
    return frozenset(task_entry_reader(DEFAULT_FAMILY).task_fields)


def local_name(ref: str) -> str:
    """The folder name of a local path, whatever its system's separator (``""`` for a root)."""
    return re.split(r"[\\/]", ref.rstrip("\\/"))[-1]


def is_published_local(ref: Any) -> bool:
    """Whether ``ref`` is a local input as a release names it (``local:<folder name>``)."""
    return isinstance(ref, str) and ref.startswith(LOCAL_MARK)


def published_ref(ref: str | None) -> str | None:
    """``ref`` as a release names it: a Hub id unchanged, a local folder as ``local:<folder name>``.

    Args:
        ref: A model or dataset reference from a run's recipe (a path or a Hub id), or None.

    Returns:
        The reference to publish; None and ``""`` are returned as they are.
    """
    if not ref or is_published_local(ref) or is_hub_id(ref):
        return ref
    return LOCAL_MARK + local_name(ref)


def published_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The copy of a run's ``run_config.json`` that a release publishes: no local path in it.

    The references to inputs (``base_model_id``, ``experts``, each task's ``dataset.path`` and
    ``expert``, ``merge.from``) become :func:`published_ref`; any other string value that looks like
    an absolute path (``/…``, ``~…``, ``C:\\…``) is named by its last component the same way, so a
    field added to the recipe later cannot leak a local path either. A task entry's own fields (its family's
    ``task_fields``: an image entry's class names and prompt templates, a text entry's templates, label words and
    answer rule) are prose and left as written, so a template such as ``/no_think {query}`` is kept. Everything
    else, ``run_id`` included, is unchanged.

    Args:
        config: The run folder's ``run_config.json``.

    Returns:
        A new mapping; ``config`` is not modified.
    """
    published = _sweep(config)
    published["base_model_id"] = published_ref(config.get("base_model_id"))
    if isinstance(config.get("experts"), Mapping):
        published["experts"] = {task: published_ref(ref) for task, ref in config["experts"].items()}
    if isinstance(config.get("merge"), Mapping) and config["merge"].get("from"):
        published["merge"]["from"] = published_ref(config["merge"]["from"])
    for name, entry in (config.get("tasks_table") or {}).items():
        if not isinstance(entry, Mapping):
            continue
        out = published["tasks_table"][name]
        for key in task_entry_reader(entry.get("family", DEFAULT_FAMILY)).task_fields & entry.keys():
            out[key] = copy.deepcopy(entry[key])  # the family's own fields: prose, kept as written
        if entry.get("expert"):
            out["expert"] = published_ref(entry["expert"])
        if isinstance(entry.get("dataset"), Mapping) and entry["dataset"].get("path"):
            out["dataset"]["path"] = published_ref(entry["dataset"]["path"])
    if "base_model_id" not in config:
        published.pop("base_model_id")
    return published


def _sweep(value: Any, key: str | None = None) -> Any:
    """A deep copy of ``value`` with absolute-path-looking strings published as local names."""
    if isinstance(value, Mapping):
        return {k: _sweep(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return list(value) if key in _prose_keys() else [_sweep(v) for v in value]
    if isinstance(value, str) and _ABSOLUTE.match(value):
        return LOCAL_MARK + local_name(value)
    return value


# An absolute path inside a text (a YAML value, a list item): `/…` or `~/…` after a space, quote or bracket.
_ABSOLUTE_IN_TEXT = re.compile(r"(?<=[\s'\"\[,{])~?/[^\s'\",\]}#]+")


def published_text(text: str, refs: Iterable[str] = ()) -> str:
    """A text a release quotes (``mergekit_config.yml``) with no local path in it.

    Each of ``refs`` (the references the text names, as a parser read them) that is a local folder is
    replaced by its :func:`published_ref`, then any other absolute path (``/…``, ``~/…``) by
    ``local:<last component>``. Everything else is kept verbatim.

    Args:
        text: The text.
        refs: The model references it names.

    Returns:
        The text to publish.
    """
    for ref in sorted({r for r in refs if r}, key=len, reverse=True):
        published = published_ref(ref)
        if published != ref:
            text = text.replace(ref, str(published))
    return _ABSOLUTE_IN_TEXT.sub(lambda match: LOCAL_MARK + local_name(match.group(0)), text)


def published_model_recipe(recipe: Mapping[str, Any], mergekit_refs: Iterable[str] = ()) -> dict[str, Any]:
    """The copy of a model folder's ``featcal_recipe.json`` that a release publishes: no local path in it.

    The base, the experts, the merged folder a calibration started from (``merge.from``) and each
    calibration dataset and expert (``calibration_data``) become :func:`published_ref`; a quoted
    ``mergekit_config`` becomes :func:`published_text`; any other string that looks like an absolute
    path is named by its last component, as in :func:`published_config`.

    Args:
        recipe: The contents of ``featcal_recipe.json``.
        mergekit_refs: The model references its ``mergekit_config`` names, if it has one.

    Returns:
        A new mapping; ``recipe`` is not modified.
    """
    published = _sweep(recipe)
    if recipe.get("base_model"):
        published["base_model"] = published_ref(recipe["base_model"])
    if isinstance(recipe.get("experts"), Mapping):
        published["experts"] = {k: published_ref(v) for k, v in recipe["experts"].items()}
    merge = recipe.get("merge")
    if isinstance(merge, Mapping) and merge.get("from"):
        published["merge"]["from"] = published_ref(merge["from"])
    for name, entry in (recipe.get("calibration_data") or {}).items():
        for key in ("expert", "dataset"):
            if isinstance(entry, Mapping) and entry.get(key):
                published["calibration_data"][name][key] = published_ref(entry[key])
    if isinstance(recipe.get("mergekit_config"), str):
        published["mergekit_config"] = published_text(recipe["mergekit_config"], mergekit_refs)
    return published
