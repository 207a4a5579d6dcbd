"""The calibration data file of a language-model merge: each expert's calibration texts (``--data FILE``).

A merge of language models, made by featcal or by mergekit, names its experts; the data file says
where each one's calibration texts are and how a row becomes a text. It is read into the same task
table as ``--tasks-file`` (:mod:`featcal.tasks`), one task per expert::

    max_length: 2048                        # optional: tokens per text (default 2048)
    experts:
      MergeBench/Llama-3.2-3B_math:         # the expert as the merge names it: Hub id or folder
        dataset: MergeBench/math_val        # Hub id, local folder, or .json / .jsonl / .parquet / .csv file
        split: train
        text: "{query}\\n{response}"         # a column name, or a template over the columns
      MergeBench/Llama-3.2-3B_coding:
        dataset: {path: MergeBench/coding_val, revision: main}
        prompt: "{instruction}\\n"           # or a prompt and a response ...
        response: "{response}"
        weigh: response                     # ... and only the response's tokens weigh

An entry may also name its task (``task: math``); by default it is the part of the expert's name
that differs from the other experts' (``math`` above).

An encoder-decoder's expert (T5) gives an input and a target template instead of a text, and for a
classification dataset the words of its class ids (FusionBench's GLUE targets); such entries are tasks of
the ``seq2seq`` family::

    experts:
      tanganke/flan-t5-base_glue-rte:
        dataset: nyu-mll/glue
        config: rte
        split: train
        input: "{sentence1} {sentence2}"
        target: "{label}"
        labels: [entailment, not_entailment]   # the word of class 0, of class 1
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError, InputError
from featcal.families import data_file_defaults, data_file_family, data_file_keys
from featcal.files.reading import read_structured
from featcal.hub.refs import local_path, split_revision
from featcal.tasks import TaskTable, parse_task_table

GENERIC_KEYS = ("dataset", "split", "config", "task")  # what every expert's entry may say, whatever its family


def _keys() -> tuple[frozenset[str], frozenset[str]]:
    """The keys a data file's top level and its experts' entries may give: the generic ones and each family's
    (:class:`~featcal.families.base.DataFileEntries`)."""
    keys, defaults = data_file_keys()
    return frozenset({"experts", "family", *defaults}), frozenset({*GENERIC_KEYS, *defaults, *keys})


def expert_key(ref: str) -> str:
    """How two references to one expert compare: a local path resolved, a Hub id as written."""
    local = local_path(ref)
    return str(local.expanduser().resolve()) if local is not None else ref


def task_names(refs: Sequence[str]) -> dict[str, str]:
    """A short task name for each expert reference: its name less what all the experts' names share.

    ``MergeBench/Llama-3.2-3B_math`` and ``MergeBench/Llama-3.2-3B_coding`` give ``math`` and
    ``coding``; a single expert, or names that share nothing, give the name after the last ``/``.
    """
    names = [re.split(r"[\\/]", split_revision(ref)[0].rstrip("/\\"))[-1] for ref in refs]
    if len(names) > 1:
        prefix = os.path.commonprefix(names)
        suffix = os.path.commonprefix([n[::-1] for n in names])[::-1]
        trimmed = [n[len(prefix) : len(n) - len(suffix)].strip("_-. ") for n in names]
        if all(trimmed) and len(set(trimmed)) == len(trimmed):
            names = trimmed
    cleaned = [re.sub(r"[^A-Za-z0-9_.-]+", "_", n) or "task" for n in names]
    seen: dict[str, int] = {}
    unique = []
    for name in cleaned:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return dict(zip(refs, unique))


def read_data_file(path: str | Path) -> TaskTable:
    """The task table of a calibration data file: one task per expert, in the file's order.

    Args:
        path: The YAML or JSON file.

    Returns:
        The tasks (of the family whose entries the expert's is, :func:`~featcal.families.data_file_family`,
        unless the file's ``family`` says otherwise), each with its expert, dataset and text format.

    Raises:
        InputError: naming the file, the entry and the fix, for anything that is not a valid data file.
    """
    path = Path(path).expanduser()
    data = read_structured(path, "Calibration data file")
    if not isinstance(data, Mapping) or not isinstance(data.get("experts"), Mapping) or not data["experts"]:
        raise InputError(
            path, f"Calibration data file {path}: expected 'experts:' mapping each expert to its calibration texts."
        )
    top_keys, entry_keys = _keys()
    unknown = sorted(set(map(str, data)) - top_keys)
    if unknown:
        raise InputError(path, f"Calibration data file {path}: unknown key(s) {unknown}; known: {sorted(top_keys)}.")
    experts: Mapping[Any, Any] = data["experts"]
    refs = [str(ref) for ref in experts]
    named = task_names(refs)
    tasks: dict[str, dict[str, Any]] = {}
    for ref, entry in experts.items():
        where = f"Calibration data file {path}, expert {ref!r}"
        if not isinstance(entry, Mapping):
            raise InputError(
                path, f"{where}: expected a mapping with 'dataset' and 'text' (or 'prompt' and 'response')."
            )
        bad = sorted(set(map(str, entry)) - entry_keys)
        if bad:
            raise InputError(path, f"{where}: unknown key(s) {bad}; known: {sorted(entry_keys)}.")
        name = str(entry.get("task") or named[str(ref)])
        if name in tasks:
            raise InputError(
                path, f"{where}: task name {name!r} is taken by another expert: set 'task' to tell them apart."
            )
        tasks[name] = _task_entry(str(ref), entry, data, where, path)
    try:
        return parse_task_table({"tasks": tasks}, root=path.parent.resolve(), source=str(path))
    except InputError:
        raise
    except FeatcalError as exc:  # the task table's own checks, which name the file and the task
        raise InputError(path, str(exc)) from None


def _task_entry(ref: str, entry: Mapping[str, Any], top: Mapping[str, Any], where: str, path: Path) -> dict[str, Any]:
    """One expert's entry as a task-table entry."""
    dataset = entry.get("dataset")
    if isinstance(dataset, str):
        dataset = {"path": dataset}
    if not isinstance(dataset, Mapping) or "path" not in dataset:
        raise InputError(path, f"{where}: 'dataset' must be a Hub id, a folder or a file (or a mapping with 'path').")
    dataset = dict(dataset)
    if entry.get("split") is not None:
        dataset["train_split"] = entry["split"]
    if entry.get("config") is not None:
        dataset["name"] = entry["config"]
    family = str(top.get("family", data_file_family(entry)))
    task: dict[str, Any] = {"family": family, "dataset": dataset, "expert": ref}
    keys, defaults = data_file_keys()
    for key in keys:  # every family's: another family's key is refused by the task table, naming it
        if entry.get(key) is not None:
            task[key] = entry[key]
    own = data_file_defaults(family)
    for key in defaults:  # the file's defaults where the family has them
        value = entry.get(key, top.get(key) if key in own else None)
        if value is not None:
            task[key] = value
    return task
