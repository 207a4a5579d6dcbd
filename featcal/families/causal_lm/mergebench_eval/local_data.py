"""Local copies of the benchmarks' data, and lm-evaluation-harness's task definitions pointed at them.

A folder of local copies holds each dataset the protocol reads in its Hub format, one JSON-lines file a
split: ``<folder>/<dataset id>/<configuration or "default">/<split>.jsonl`` (``openai/gsm8k/main/test.jsonl``,
``evalplus/humanevalplus/default/test.jsonl``), each row as the Hub's dataset has it. For each harness
task, a definition is written that includes the harness's own (its prompts, few-shot samples, filters,
metrics and processing functions, unchanged) and replaces only where its data is read from: the JSON
files of the splits the task reads. Nothing is downloaded. The datasets and splits come from the harness's
definitions themselves, so they are those a run on the Hub would read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from featcal.errors import DatasetInputError, FeatcalError
from featcal.families.causal_lm.mergebench_eval.protocol import CodeTask, HarnessTask

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
DEFAULT_CONFIG = "default"


def harness_folder() -> Path:
    """The folder of lm-evaluation-harness's own task definitions.

    Raises:
        FeatcalError: when lm-eval is not installed.
    """
    try:
        import lm_eval.tasks
    except ImportError as exc:
        from featcal.families.causal_lm.harness import INSTALL_HINT

        raise FeatcalError(f"the mergebench evaluation needs lm-evaluation-harness ({exc}): {INSTALL_HINT}.") from None
    return Path(lm_eval.tasks.__file__).parent


def harness_definition(task: HarnessTask) -> dict[str, Any]:
    """The harness's definition of ``task``, its includes merged, its functions left unresolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(harness_folder() / task.definition, resolve_func=False)


@dataclass(frozen=True)
class DataSource:
    """Where one task reads its data: a Hub dataset, its configuration, and the splits it reads."""

    dataset: str
    config: str | None
    splits: tuple[str, ...]

    def files(self, folder: Path) -> dict[str, Path]:
        """The local copy's file of each split under ``folder``."""
        where = folder / self.dataset / (self.config or DEFAULT_CONFIG)
        return {split: where / f"{split}.jsonl" for split in self.splits}


def harness_source(task: HarnessTask) -> DataSource:
    """The dataset, configuration and splits ``task``'s definition reads."""
    definition = harness_definition(task)
    splits = tuple(dict.fromkeys(str(definition[k]) for k in SPLIT_KEYS if definition.get(k)))
    return DataSource(str(definition["dataset_path"]), definition.get("dataset_name"), splits)


def code_source(task: CodeTask) -> DataSource:
    """The dataset and split a coding benchmark reads."""
    return DataSource(task.dataset, None, (task.split,))


def check_local_copies(folder: Path, sources: Sequence[DataSource]) -> None:
    """Refuse a folder of local copies that lacks a file the protocol reads.

    Args:
        folder: The folder of local copies.
        sources: What the protocol's tasks read.

    Raises:
        DatasetInputError: naming the first missing file and the layout expected.
    """
    for source in sources:
        for split, path in source.files(folder).items():
            if not path.is_file():
                raise DatasetInputError(
                    None,
                    str(path),
                    f"The local copy of {source.dataset} ({source.config or DEFAULT_CONFIG}, split {split}) is "
                    f"missing: {path} (benchmark_data holds <dataset id>/<configuration or default>/<split>.jsonl "
                    "for every dataset the protocol reads; docs/causal-lm.md).",
                )


def write_definitions(tasks: Sequence[HarnessTask], into: Path, folder: Path | None = None) -> None:
    """Write, into ``into``, one definition per task: the harness's own, reading the local copies in ``folder``
    (None: the Hub's datasets, as the harness's own definition reads them; the harness then indexes these
    definitions alone instead of all of its own).

    Args:
        tasks: The harness tasks.
        into: An empty folder for the definitions.
        folder: The folder of local copies (checked by :func:`check_local_copies`), or None.
    """
    for task in tasks:
        definition: dict[str, Any] = {"include": str(harness_folder() / task.definition), "task": task.name}
        if folder is not None:
            source = harness_source(task)
            files = {split: str(path.resolve()) for split, path in source.files(folder).items()}
            definition |= {"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": files}}
        (into / f"{task.name}.yaml").write_text(yaml.safe_dump(definition, sort_keys=False), encoding="utf-8")
