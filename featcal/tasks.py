"""Task metadata: datasets, each family's description of its tasks (their formats) and reference numbers.

One source of truth for the evaluator, the model card and the Space. The eight TA8 tasks ship with
the package (``featcal/resources/ta8_tasks.json``), and with them the 14- and 20-task suites on three
CLIP backbones (:mod:`featcal.suites`); users add or replace tasks with a tasks file in the same
schema (JSON or YAML).

A task belongs to one model family (``family``, default :data:`~featcal.families.registry.DEFAULT_FAMILY`), which
reads what else its entry says (:func:`~featcal.families.registry.task_entry_reader`: the family's
``task_fields`` and ``parse_task_fields``) into the task's :class:`TaskFormat` (``Task.text``): an image task's
classes and zero-shot prompts (the vision family's own); a text task how a row of its dataset becomes a text
(:class:`TextFormat`); a text-to-text task how it becomes an input and a target text, and how its generations are
scored (:class:`TextPairFormat`). This module reads the fields every entry has (dataset, expert, references) and
the table's; the family is reached through the registry only.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from featcal.errors import FeatcalError, UnknownNameError
from featcal.families.registry import DEFAULT_FAMILY, IMAGE_SCHEMA, task_entry_reader, task_schema
from featcal.files.reading import read_structured
from featcal.hub.refs import local_path, split_revision
from featcal.metrics import RESERVED_TASK_NAMES

BUILTIN_TABLE = "ta8_tasks.json"


@dataclass(frozen=True)
class DatasetSpec:
    """Where a task's examples live: a Hub dataset id or a local folder in the Hub parquet layout.

    ``revision`` pins a Hub dataset to a branch, tag or commit (a tasks file may also write it as
    ``path: namespace/name@revision``); without it the dataset's ``main`` is read.
    """

    path: str
    name: str | None = None
    train_split: str = "train"
    test_split: str = "test"
    image_column: str = "image"
    label_column: str = "label"
    revision: str | None = None

    def is_one_file(self) -> bool:
        """Whether the dataset is one local ``.json``, ``.jsonl``, ``.parquet`` or ``.csv`` file: every split
        at once (``datasets`` names its rows ``train``, whatever split a task table gives)."""
        local = local_path(self.path)
        return local is not None and local.is_file()

    def evaluates_calibration_rows(self) -> bool:
        """Whether evaluation reads the rows calibration draws from: one file, or one split named for both (its
        evaluated rows are then held out of the calibration's shuffle, :func:`featcal.data.held_out_indices`)."""
        return self.is_one_file() or self.train_split == self.test_split

    def calibration_split(self) -> str:
        """The split calibration reads, by the name ``datasets`` gives it (``train`` for one file)."""
        return "train" if self.is_one_file() else self.train_split

    def evaluated_split(self) -> str:
        """The split evaluation reads, by the name ``datasets`` gives it (``train`` for one file)."""
        return "train" if self.is_one_file() else self.test_split


DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")  # a text task's dataset as one local file
GLUE_IDS = ("nyu-mll/glue", "glue")  # GLUE's Hub id, and its legacy alias (FusionBench's)
GLUE_CONFIGS = (
    "ax", "cola", "mnli", "mnli_matched", "mnli_mismatched", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli",
)  # fmt: skip
DEFAULT_INPUT_LENGTH = 512  # tokens of an input text (T5's model_max_length, FusionBench's GLUE inputs)
DEFAULT_TARGET_LENGTH = 128  # tokens of a target text
DEFAULT_MAX_LENGTH = 2048  # tokens of a calibration text (MergeBench's SFT length)


@dataclass(frozen=True)
class TextFormat:
    """How a row of a text task's dataset becomes one calibration text.

    Either ``text`` alone, or ``prompt`` and ``response`` (the text is the prompt followed by the
    response). Each is a column name or a template over the row's columns (``"{query}\n{response}"``).

    Attributes:
        text: The whole text.
        prompt: The text's first part (an instruction, a question).
        response: Its second part (the answer).
        weigh: ``all`` (every token of the text weighs 1) or ``response`` (the prompt's tokens weigh
            0); ``response`` needs ``prompt`` and ``response``.
        max_length: Texts are cut after this many tokens.
        answer: How the one answer of a response is found, for a task whose responses have one
            (``line``, ``boxed`` or a regular expression with one group: see
            :mod:`featcal.families.causal_lm.answers`); its evaluation then measures exact match. None: the
            responses have no single answer (loss only). Needs ``prompt`` and ``response``.
    """

    text: str | None = None
    prompt: str | None = None
    response: str | None = None
    weigh: str = "all"
    max_length: int = DEFAULT_MAX_LENGTH
    answer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry's keys: those set, ``weigh`` and ``max_length`` always, and ``answer`` when set."""
        data: dict[str, Any] = {
            k: v for k, v in (("text", self.text), ("prompt", self.prompt), ("response", self.response)) if v
        }
        data = {**data, "weigh": self.weigh, "max_length": self.max_length}
        return data if self.answer is None else {**data, "answer": self.answer}


def format_columns(fmt: TextFormat, columns: Sequence[str]) -> list[str]:
    """The columns a text format reads: a part that is a column name reads that column, a template its fields.

    Args:
        fmt: The text format.
        columns: The dataset's columns (a part equal to one of them is that column); empty: every part is
            read as a template.

    Returns:
        The column names, in the order the parts read them (repeats kept).
    """
    names: list[str] = []
    for part in (fmt.text, fmt.prompt, fmt.response):
        if part is None:
            continue
        if part in columns:
            names.append(part)
            continue
        names.extend(field for _, field, _, _ in string.Formatter().parse(part) if field)
    return names


@dataclass(frozen=True)
class TextPairFormat:
    """How a row of a seq2seq task's dataset becomes an input text and a target text, and how the model's
    generations are scored.

    Attributes:
        input: The input, a template over the row's columns (``"{sentence1} {sentence2}"``).
        target: The target, a template likewise (``"{label}"``, ``"{label:.1f}"``).
        labels: The words of the label column's class ids, in id order (the target of class 0 is
            ``labels[0]``); empty when the targets are the columns' own values.
        metric: ``exact_match`` (the fraction of generations equal to the target) or ``spearman`` (Spearman's
            ρ of the generations read as numbers against the targets, an unparsable one counting 0.0).
        max_length: Inputs are cut after this many tokens.
        target_max_length: Targets are cut after this many tokens.
    """

    input: str
    target: str
    labels: tuple[str, ...] = ()
    metric: str = "exact_match"
    max_length: int = DEFAULT_INPUT_LENGTH
    target_max_length: int = DEFAULT_TARGET_LENGTH

    def listing(self) -> dict[str, Any]:
        """What a suite's description says of the task (:func:`featcal.suites.describe_suite`): its classes (its
        label words), its one input template and its metric."""
        return {"classes": len(self.labels), "templates": 1, "metric": self.metric}

    def to_dict(self) -> dict[str, Any]:
        """The entry's keys (``labels`` only when set)."""
        data: dict[str, Any] = {"input": self.input, "target": self.target}
        if self.labels:
            data["labels"] = list(self.labels)
        return {
            **data, "metric": self.metric, "max_length": self.max_length, "target_max_length": self.target_max_length,
        }  # fmt: skip


class TaskFormat(Protocol):
    """A family's own description of its tasks beyond the common fields (:class:`TextFormat`,
    :class:`TextPairFormat`, or another family's), as its ``parse_task_fields`` makes it."""

    def to_dict(self) -> dict[str, Any]:
        """The entry's keys, as a tasks file writes them (and the family's parser reads them back)."""


@dataclass(frozen=True)
class Task:
    """One task: its data, its family's description of it (its :class:`TaskFormat`, ``text``: the texts it is
    read as or classified by) and (optionally) its expert."""

    name: str
    dataset: DatasetSpec
    expert: str | None = None
    reference_accuracy: Mapping[str, float] = field(default_factory=dict)
    reference_source: str | None = None
    family: str = DEFAULT_FAMILY
    text: TaskFormat | None = None

    def to_dict(self) -> dict[str, Any]:
        """The task's entry as a tasks file writes it (and a run records it): the common fields and its format's
        keys, which an ``image`` entry gives right after its dataset and any other entry last."""
        data = asdict(self)
        data.pop("name")
        data.pop("text")
        own = self.text.to_dict() if self.text is not None else {}
        if task_schema(self.family) == IMAGE_SCHEMA:
            data = {"dataset": data.pop("dataset"), **own, **data}
        else:
            data.update(own)
        data["reference_accuracy"] = dict(self.reference_accuracy)
        if self.dataset.revision is None:  # absent rather than null: unpinned tables record as before
            data["dataset"].pop("revision")
        if self.reference_source is None:  # absent rather than null: tables without one record as before
            data.pop("reference_source")
        if self.family == DEFAULT_FAMILY:  # likewise: an entry of the default family names no family
            data.pop("family")
        return data


# The top-level keys of a tasks file (``about`` and ``source`` are notes for readers).
TABLE_KEYS = frozenset({"tasks", "base_model", "expert_model_pattern", "reference_average", "about", "source"})


@dataclass(frozen=True)
class TaskTable:
    """A set of tasks plus the defaults that go with them (base model, expert id pattern, and the merging
    methods' hyper-parameters a built-in suite sets: MergeBench's Task Arithmetic)."""

    tasks: Mapping[str, Task]
    base_model: str | None = None
    expert_model_pattern: str | None = None
    reference_average: Mapping[str, float] = field(default_factory=dict)
    source: str = "built-in"
    merge_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def select(self, names: Sequence[str] | None) -> list[Task]:
        """The tasks named, in the order given (all tasks when ``names`` is empty)."""
        if not names:
            return list(self.tasks.values())
        unknown = [n for n in names if n not in self.tasks]
        if unknown:
            raise UnknownNameError(
                "task(s)",
                unknown,
                sorted(self.tasks),
                hint=f"The {self.source} tasks lack them: add them with a tasks file.",
            )
        return [self.tasks[n] for n in names]

    def merged_with(self, other: TaskTable) -> TaskTable:
        """This table with ``other``'s tasks added or replacing same-named ones."""
        return TaskTable(
            tasks={**self.tasks, **other.tasks},
            base_model=other.base_model or self.base_model,
            expert_model_pattern=other.expert_model_pattern or self.expert_model_pattern,
            reference_average=other.reference_average or self.reference_average,
            source=f"{self.source} + {other.source}",
            merge_defaults=other.merge_defaults or self.merge_defaults,
        )


def _resolve_ref(value: str | None, root: Path | None) -> str | None:
    """``value`` as written in a tasks file: a local path made absolute (relative to ``root``), else as is."""
    if value is None:
        return None
    local = local_path(value, root)
    if local is None:
        return value
    return str(local if local.is_absolute() else local.resolve())


COMMON_FIELDS = frozenset({"dataset", "expert", "reference_accuracy", "reference_source", "family"})


def _parse_dataset(entry: Mapping[str, Any], root: Path | None, where: str) -> DatasetSpec:
    dataset = entry.get("dataset")
    if isinstance(dataset, str):
        dataset = {"path": dataset}
    if not isinstance(dataset, Mapping) or not isinstance(dataset.get("path"), str):
        raise FeatcalError(f"{where}: 'dataset' needs a 'path' (a Hub dataset id or a local folder).")
    allowed = {f for f in DatasetSpec.__dataclass_fields__}
    bad = set(dataset) - allowed
    if bad:
        raise FeatcalError(f"{where}: unknown dataset field(s) {sorted(bad)}; allowed: {sorted(allowed)}.")
    optional = ("name", "revision")
    not_text = sorted(k for k, v in dataset.items() if not isinstance(v, str) and not (k in optional and v is None))
    if not_text:
        raise FeatcalError(f"{where}: dataset field(s) {not_text} must be text.")
    path = _resolve_ref(dataset["path"], root)
    repo, pinned = split_revision(path) if local_path(path) is None else (path, None)
    if repo in GLUE_IDS and dataset.get("name") not in GLUE_CONFIGS:
        raise FeatcalError(
            f"{where}: GLUE has no configuration {dataset.get('name')!r}; it has {', '.join(GLUE_CONFIGS)}."
        )
    if pinned is not None and dataset.get("revision") is not None:
        raise FeatcalError(f"{where}: the dataset pins a revision twice ('@' in 'path' and 'revision'): keep one.")
    return DatasetSpec(**{**dataset, "path": repo, "revision": dataset.get("revision") or pinned})


def _parse_task(name: str, entry: Any, root: Path | None, source: str) -> Task:
    where = f"task {name!r} in {source}"
    if not isinstance(entry, Mapping):
        raise FeatcalError(f"{where}: expected a mapping, got {type(entry).__name__}.")
    family = entry.get("family", DEFAULT_FAMILY)
    if not isinstance(family, str):
        raise FeatcalError(f"{where}: 'family' must name a model family (e.g. {DEFAULT_FAMILY}).")
    reader = task_entry_reader(family)  # the family's own fields are the family's to read
    unknown = set(entry) - COMMON_FIELDS - reader.task_fields
    if unknown:
        raise FeatcalError(f"{where}: unknown field(s) {sorted(unknown)}.")
    spec = _parse_dataset(entry, root, where)
    own = reader.parse_task_fields(entry, where)
    expert = entry.get("expert")
    if expert is not None and not isinstance(expert, str):
        raise FeatcalError(f"{where}: 'expert' must be a model id or folder.")
    reference = entry.get("reference_accuracy") or {}
    if not isinstance(reference, Mapping):
        raise FeatcalError(f"{where}: 'reference_accuracy' must map method names to accuracies.")
    source = entry.get("reference_source")
    if source is not None and not isinstance(source, str):
        raise FeatcalError(f"{where}: 'reference_source' must say in words where the reference accuracies come from.")
    return Task(
        family=family,
        name=name,
        dataset=spec,
        expert=_resolve_ref(expert, root),
        reference_accuracy={str(k): float(v) for k, v in reference.items()},
        reference_source=source,
        **own,
    )


def parse_task_table(data: Any, *, root: Path | None = None, source: str = "tasks file") -> TaskTable:
    """Validate a task table given as plain data (``{"tasks": {...}}`` or a bare mapping of tasks)."""
    if not isinstance(data, Mapping):
        raise FeatcalError(f"{source}: expected a mapping of task names to entries.")
    entries = data["tasks"] if "tasks" in data else data
    if not isinstance(entries, Mapping) or not entries:
        raise FeatcalError(f"{source}: 'tasks' must be a non-empty mapping of task names to entries.")
    if "tasks" in data:
        unknown = sorted(set(map(str, data)) - TABLE_KEYS)
        if unknown:
            raise FeatcalError(f"{source}: unknown top-level key(s) {unknown}; known: {sorted(TABLE_KEYS)}.")
        for key in ("base_model", "expert_model_pattern"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise FeatcalError(f"{source}: '{key}' must be text (a model id or folder, or a pattern).")
        if not isinstance(data.get("reference_average") or {}, Mapping):
            raise FeatcalError(f"{source}: 'reference_average' must map method names to accuracies.")
    reserved = sorted(str(name) for name in entries if str(name) in RESERVED_TASK_NAMES)
    if reserved:
        raise FeatcalError(
            f"{source}: task name(s) {reserved} are reserved for the metrics report "
            f"({', '.join(sorted(RESERVED_TASK_NAMES))}); rename the task."
        )
    tasks = {str(name): _parse_task(str(name), entry, root, source) for name, entry in entries.items()}
    return TaskTable(
        tasks=tasks,
        base_model=_resolve_ref(data.get("base_model"), root) if "tasks" in data else None,
        expert_model_pattern=data.get("expert_model_pattern") if "tasks" in data else None,
        reference_average=dict(data.get("reference_average") or {}) if "tasks" in data else {},
        source=source,
    )


def load_task_file(path: str | Path) -> TaskTable:
    """Read and validate a JSON or YAML tasks file; relative local paths resolve against its folder."""
    path = Path(path).expanduser()
    data = read_structured(path, "Tasks file")
    return parse_task_table(data, root=path.parent.resolve(), source=str(path))


def builtin_tasks() -> TaskTable:
    """The eight TA8 tasks of the FeatCal reference run."""
    text = resources.files("featcal.resources").joinpath(BUILTIN_TABLE).read_text(encoding="utf-8")
    return parse_task_table(json.loads(text), root=None, source="built-in TA8")
