"""Calibration texts of a causal-LM task: a dataset's rows made texts, tokenised into calibration batches.

A text task's dataset is a Hub dataset id, a local folder in the Hub's parquet layout, or one local
``.json``, ``.jsonl``, ``.parquet`` or ``.csv`` file. Its :class:`~featcal.tasks.TextFormat` says how a
row becomes a text: a column, or a template over the columns (``"{query}\\n{response}"``), or a prompt
and a response. Texts are tokenised by the base's tokenizer, cut at ``max_length`` tokens and
right-padded to the longest; padding weighs 0 in the calibration's statistics, and with
``weigh: response`` so do the prompt's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal.calibration.adapters import CalibrationBatch
from featcal.data import load_dataset_split, process_calibration_rows
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError, ModelInputError
from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS
from featcal.files.reading import check_utf8
from featcal.hub.refs import local_path
from featcal.tasks import DATA_FILE_SUFFIXES, Task, TextFormat, format_columns

logger = logging.getLogger(__name__)

# A local data file's suffix -> the datasets builder that reads it.
NO_POSITION_LIMIT = int(1e30)  # transformers' own "no limit" for a tokenizer's model_max_length
FILE_BUILDERS = dict(zip(DATA_FILE_SUFFIXES, ("json", "json", "parquet", "csv")))


def load_text_split(task: Task, split: str = "train") -> Any:
    """The split of a text task's dataset that holds its calibration texts (``train_split``).

    Raises:
        DatasetInputError: the dataset cannot be loaded, is empty, or lacks a column the format reads.
    """
    rows = load_rows(task, split)
    fmt = _text_format(task)
    missing = sorted({c for c in format_columns(fmt, rows.column_names) if c not in rows.column_names})
    if missing:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the text format reads column(s) {missing}, which {task.dataset.path} lacks; it has "
            f"{rows.column_names}.",
        )
    return rows


def load_rows(task: Task, split: str = "train") -> Any:
    """The rows of a text task's ``train`` (or ``test``) split: of a Hub dataset or a local folder, or of one
    local ``.json``, ``.jsonl``, ``.parquet`` or ``.csv`` file (which is every split at once).

    Raises:
        DatasetInputError: the dataset cannot be loaded, or is empty.
        InputError: a local JSON, JSON-lines or CSV file that is not UTF-8 text (naming the line).
    """
    import datasets

    spec = task.dataset
    split_name = spec.train_split if split == "train" else spec.test_split
    local = local_path(spec.path)
    if local is not None and local.is_file():
        builder = FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DatasetInputError(
                task.name,
                spec.path,
                f"Task {task.name!r}: {spec.path} is neither a dataset folder nor a .json, .jsonl, .parquet or "
                ".csv file.",
            )
        if builder != "parquet":
            check_utf8(local, f"Task {task.name!r}: the dataset file")
        try:
            rows = datasets.load_dataset(builder, data_files=str(local), split="train")
        except Exception as exc:  # datasets raises many kinds for a file it cannot parse
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatasetInputError(
                task.name, spec.path, f"Task {task.name!r}: {spec.path} does not read as {builder} ({reason})."
            ) from None
    else:
        rows = load_dataset_split(spec.path, split_name, name=spec.name, task=task.name, revision=spec.revision)
    if len(rows) == 0:
        raise DatasetInputError(task.name, spec.path, f"Task {task.name!r}: {spec.path} holds no rows.")
    return rows


def _text_format(task: Task) -> TextFormat:
    if task.text is None:
        raise DatasetInputError(task.name, task.dataset.path, f"Task {task.name!r} says nothing of how to read texts.")
    return task.text


def _render(part: str, row: Mapping[str, Any]) -> str:
    if part in row:
        return str(row[part])
    return part.format_map({k: "" if v is None else v for k, v in row.items()})


def render_text(task: Task, row: Mapping[str, Any]) -> tuple[str, str]:
    """One row as ``(prompt, response)``: a ``text`` format gives the whole text as the prompt."""
    fmt = _text_format(task)
    if fmt.text is not None:
        return _render(fmt.text, row), ""
    return _render(fmt.prompt or "", row), _render(fmt.response or "", row)


@dataclass(frozen=True)
class TextFacts:
    """What tokenising a task's calibration texts found: how many were cut at ``max_length``."""

    texts: int
    cut: int
    max_length: int
    longest: int


def check_texts(task: Task, rows: Any, indices: Sequence[int], tokenizer: Any | None) -> TextFacts | None:
    """Render (and, with ``tokenizer``, tokenise) the rows a calibration will read, so that an empty text,
    a missing field or a limit that leaves no token to weigh is named before any work.

    Raises:
        DatasetInputError: naming the task, the row and the fix.
    """
    fmt = _text_format(task)
    texts = []
    for index in indices:
        row = rows[int(index)]
        try:
            prompt, response = render_text(task, row)
        except (KeyError, IndexError, ValueError) as exc:
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: row {index} does not fill the text format ({exc}): check its templates "
                f"against the columns {list(row)}.",
            ) from None
        if not (prompt + response).strip() or (fmt.weigh == "response" and not response.strip()):
            what = "response" if fmt.weigh == "response" else "text"
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: row {index} of {task.dataset.path} gives an empty {what}: drop such rows from "
                "the calibration data.",
            )
        texts.append((prompt, response))
    if tokenizer is None:
        return None
    encoded = encode_texts(tokenizer, texts, fmt)
    limit = (
        f"max_length {fmt.max_length} tokens: raise 'max_length' in the data file (or shorten the texts)"
        if encoded.facts.max_length == fmt.max_length
        else f"the model's {encoded.facts.max_length} positions (fewer than max_length): shorten the texts"
    )
    if encoded.facts.cut == encoded.facts.texts:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: every calibration text is longer than {limit}.",
        )
    weights = encoded.batch.token_weights
    if weights is not None and bool((weights.sum(1) == 0).all()):
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: with max_length {fmt.max_length}, no response token of any text is left to "
            "weigh: raise 'max_length' in the data file.",
        )
    return encoded.facts


@dataclass(frozen=True)
class EncodedTexts:
    """Texts as a calibration batch, and what tokenising them found."""

    batch: CalibrationBatch
    facts: TextFacts


def encode_texts(tokenizer: Any, texts: Sequence[tuple[str, str]], fmt: TextFormat) -> EncodedTexts:
    """``(prompt, response)`` pairs as one calibration batch, right-padded to the longest (at most
    ``fmt.max_length`` tokens, and at most the model's positions: the tokenizer's ``model_max_length``, which
    :func:`base_tokenizer` sets to them).

    Every token of a text weighs 1 and padding 0; with ``weigh: response`` the prompt's tokens weigh 0
    too (a token belongs to the response when it starts at or after the response's first character).

    Args:
        tokenizer: The base's fast tokenizer.
        texts: The texts, as prompt and response (a whole text is a prompt with an empty response).
        fmt: The task's text format (``max_length``, ``weigh``).

    Returns:
        The batch (``input_ids``, the ``attention_mask`` as context, the token weights) and the cut.
    """
    whole = [prompt + response for prompt, response in texts]
    full = tokenizer(whole, add_special_tokens=True, truncation=False)["input_ids"]
    longest = max(len(ids) for ids in full)
    limit = min(fmt.max_length, tokenizer.model_max_length)  # the model's positions, when fewer
    length = min(longest, limit)
    encoded = tokenizer(
        whole,
        add_special_tokens=True,
        truncation=True,
        max_length=length,
        padding="max_length",
        return_offsets_mapping=fmt.weigh == "response",
        return_tensors="pt",
    )
    mask = encoded[ATTENTION_MASK]
    weights = mask.to(torch.float32)
    if fmt.weigh == "response":
        starts = torch.tensor([len(prompt) for prompt, _ in texts]).unsqueeze(1)
        offsets = encoded["offset_mapping"]
        in_response = (offsets[..., 0] >= starts) & (offsets[..., 1] > offsets[..., 0])
        weights = weights * in_response.to(torch.float32)
    cut = sum(len(ids) > length for ids in full)
    facts = TextFacts(texts=len(texts), cut=cut, max_length=limit, longest=longest)
    batch = CalibrationBatch({INPUT_IDS: encoded[INPUT_IDS]}, {ATTENTION_MASK: mask}, weights)
    return EncodedTexts(batch, facts)


def calibration_texts(
    task: Task, tokenizer: Any, n: int, seed: int, *, world: World = SINGLE, rows: Any | None = None
) -> CalibrationBatch:
    """A task's calibration texts (the first ``n`` rows after one shuffle with ``seed``; this process's part
    under torchrun) as one calibration batch.

    Raises:
        DatasetInputError: the dataset cannot be read, or has fewer texts than there are processes.
    """
    rows = load_text_split(task) if rows is None else rows
    indices = process_calibration_rows(task, len(rows), n, seed, world, "text(s)")
    encoded = encode_texts(tokenizer, [render_text(task, rows[int(i)]) for i in indices], _text_format(task))
    if encoded.facts.cut and world.is_main:
        logger.info(
            "Task %s: %d of %d calibration texts cut at %d tokens (max_length, or the model's positions when fewer; "
            "the longest has %d)",
            task.name,
            encoded.facts.cut,
            encoded.facts.texts,
            encoded.facts.max_length,
            encoded.facts.longest,
        )
    return encoded.batch


def first_texts(task: Task, tokenizer: Any, n: int) -> CalibrationBatch:
    """The first ``n`` texts of a task's split (all of them when it has fewer), as one batch."""
    rows = load_text_split(task)
    texts = [render_text(task, rows[i]) for i in range(min(n, len(rows)))]
    return encode_texts(tokenizer, texts, _text_format(task)).batch


def base_tokenizer(base_folder: Path) -> Any:
    """The base's fast tokenizer, padding on the right (with its end-of-text token when it has no padding
    token: padded positions weigh 0 and are masked, so their id does not matter).

    Raises:
        ModelInputError: when the base has no fast tokenizer (``tokenizer.json``) transformers can read.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base_folder))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(
            str(base_folder), f"The base model {base_folder} has no usable tokenizer ({first})."
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ModelInputError(
            str(base_folder),
            f"The base model {base_folder} has no fast tokenizer (tokenizer.json), which featcal needs to find "
            "where each response starts: save it with a recent transformers.",
        )
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    # the model's positions, which no text is read past (:func:`encode_texts`); none: no limit but max_length
    tokenizer.model_max_length = model_positions(base_folder) or NO_POSITION_LIMIT
    return tokenizer


def model_positions(folder: Path) -> int | None:
    """The positions a model folder's configuration gives its model (``max_position_embeddings``), if any."""
    from featcal.families.causal_lm.folders import load_config

    positions = getattr(load_config(folder), "max_position_embeddings", None)
    return int(positions) if isinstance(positions, int) and positions > 0 else None
