"""Text-to-text examples of a seq2seq task: a dataset's rows made (input, target) pairs, tokenised into batches.

A task's :class:`~featcal.tasks.TextPairFormat` says how a row becomes a pair: an ``input`` and a ``target``
template over the row's columns, and, for a classification dataset, the ``labels`` words its class ids stand
for (FusionBench's GLUE targets: ``{label}`` of an RTE row with class 0 is ``entailment``). Inputs are cut at
``max_length`` tokens and targets at ``target_max_length``, each right-padded to its longest; the decoder reads
the target shifted right by one (teacher forcing: the first position reads the decoder's start token, T5's
padding token). Padding weighs 0 in the calibration's statistics, and so do the decoder positions beyond each
target.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal.calibration.adapters import CalibrationBatch
from featcal.data import process_calibration_rows
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError, ModelInputError
from featcal.families.causal_lm.texts import load_rows
from featcal.families.seq2seq.adapter import ATTENTION_MASK, DECODER_ATTENTION_MASK, DECODER_INPUT_IDS, INPUT_IDS
from featcal.tasks import Task, TextPairFormat


def pair_format(task: Task) -> TextPairFormat:
    """The task's text-to-text format.

    Raises:
        DatasetInputError: for a task that has none.
    """
    if not isinstance(task.text, TextPairFormat):
        raise DatasetInputError(
            task.name, task.dataset.path, f"Task {task.name!r} says nothing of its input and target texts."
        )
    return task.text


def template_fields(template: str) -> list[str]:
    """The columns a template reads (``{sentence1}`` and ``{label:.1f}`` read ``sentence1`` and ``label``)."""
    return [field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(template) if field]


def load_pair_split(task: Task, split: str = "train") -> Any:
    """The task's ``train`` split (its calibration pairs) or ``test`` split (its evaluation), checked: every
    column the templates read is there, and a ``labels`` list names every class of a class-label column.

    Raises:
        DatasetInputError: the dataset cannot be loaded, is empty, lacks a column, or has another number of
            classes than ``labels`` names.
    """
    fmt = pair_format(task)
    rows = load_rows(task, split)
    missing = sorted({c for t in (fmt.input, fmt.target) for c in template_fields(t) if c not in rows.column_names})
    if missing:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the input and target templates read column(s) {missing}, which "
            f"{task.dataset.path} lacks; it has {rows.column_names}.",
        )
    column = task.dataset.label_column
    feature = getattr(rows, "features", {}).get(column)
    classes = getattr(feature, "num_classes", None)
    if fmt.labels and classes is not None and classes != len(fmt.labels):
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: 'labels' names {len(fmt.labels)} words, but the {column!r} column of "
            f"{task.dataset.path} has {classes} classes ({', '.join(feature.names)}): give one word per class, in "
            "class order.",
        )
    return rows


def render_pair(task: Task, row: Mapping[str, Any]) -> tuple[str, str]:
    """One row as ``(input, target)``; with ``labels``, the label column's class id is its word.

    Raises:
        DatasetInputError: for a class id ``labels`` has no word for.
    """
    fmt = pair_format(task)
    values = {k: "" if v is None else v for k, v in row.items()}
    column = task.dataset.label_column
    if fmt.labels and column in values:
        label = values[column]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(fmt.labels):
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: a row's {column!r} is {label!r}, not a class id of 'labels' "
                f"(0 to {len(fmt.labels) - 1}): drop unlabelled rows (GLUE's test splits) from the data.",
            )
        values[column] = fmt.labels[label]
    return fmt.input.format_map(values), fmt.target.format_map(values)


@dataclass(frozen=True)
class PairFacts:
    """What tokenising a task's pairs found: how many inputs and targets were cut at their limits."""

    pairs: int
    cut_inputs: int
    cut_targets: int
    max_length: int
    target_max_length: int


@dataclass(frozen=True)
class EncodedPairs:
    """Pairs as a calibration batch, and what tokenising them found."""

    batch: CalibrationBatch
    facts: PairFacts


def encode_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], *, max_length: int, target_max_length: int
) -> EncodedPairs:
    """``(input, target)`` pairs as one calibration batch (see the module docstring).

    Args:
        tokenizer: The base's tokenizer (its padding token is the decoder's start token, as in T5).
        pairs: The pairs.
        max_length: Inputs are cut after this many tokens.
        target_max_length: Targets are cut after this many tokens.

    Returns:
        The batch (``input_ids`` and ``decoder_input_ids``; both attention masks as context; token weights
        ``[rows, input positions + decoder positions]``) and the cut.
    """
    inputs, targets = [p[0] for p in pairs], [p[1] for p in pairs]
    full_inputs = tokenizer(inputs, truncation=False)["input_ids"]
    full_targets = tokenizer(targets, truncation=False)["input_ids"]
    encoder = tokenizer(inputs, truncation=True, max_length=max_length, padding="longest", return_tensors="pt")
    labels = tokenizer(targets, truncation=True, max_length=target_max_length, padding="longest", return_tensors="pt")
    start = tokenizer.pad_token_id
    target_ids, target_mask = labels[INPUT_IDS], labels[ATTENTION_MASK]
    decoder_ids = torch.cat([torch.full_like(target_ids[:, :1], start), target_ids[:, :-1]], dim=1)
    mask = encoder[ATTENTION_MASK]
    weights = torch.cat([mask, target_mask], dim=1).to(torch.float32)
    batch = CalibrationBatch(
        {INPUT_IDS: encoder[INPUT_IDS], DECODER_INPUT_IDS: decoder_ids},
        {ATTENTION_MASK: mask, DECODER_ATTENTION_MASK: target_mask},
        weights,
    )
    facts = PairFacts(
        pairs=len(pairs),
        cut_inputs=sum(len(ids) > max_length for ids in full_inputs),
        cut_targets=sum(len(ids) > target_max_length for ids in full_targets),
        max_length=max_length,
        target_max_length=target_max_length,
    )
    return EncodedPairs(batch, facts)


def encode_task_pairs(task: Task, tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> EncodedPairs:
    """Pairs of ``task`` encoded with its format's limits."""
    fmt = pair_format(task)
    return encode_pairs(tokenizer, pairs, max_length=fmt.max_length, target_max_length=fmt.target_max_length)


def check_pairs(task: Task, rows: Any, indices: Sequence[int], tokenizer: Any | None) -> PairFacts | None:
    """Render (and, with ``tokenizer``, tokenise) the rows a calibration will read, so that a missing field, an
    empty target or a class id without a word is named before any work.

    Raises:
        DatasetInputError: naming the task, the row and the fix.
    """
    pairs = []
    for index in indices:
        row = rows[int(index)]
        try:
            pair = render_pair(task, row)
        except (KeyError, IndexError, ValueError) as exc:
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: row {index} does not fill the input and target templates ({exc}): check them "
                f"against the columns {list(row)}.",
            ) from None
        if not pair[0].strip() or not pair[1].strip():
            what = "input" if not pair[0].strip() else "target"
            raise DatasetInputError(
                task.name,
                task.dataset.path,
                f"Task {task.name!r}: row {index} of {task.dataset.path} gives an empty {what}: drop such rows from "
                "the data.",
            )
        pairs.append(pair)
    if tokenizer is None:
        return None
    check_label_words(task, tokenizer)
    return encode_task_pairs(task, tokenizer, pairs).facts


def check_label_words(task: Task, tokenizer: Any) -> None:
    """Refuse ``labels`` words the tokenizer cannot spell: a word with the unknown token in its tokens, or two
    words with the same tokens, would give classes targets the model cannot tell apart.

    Raises:
        DatasetInputError: naming the task, the words and the fix.
    """
    words = pair_format(task).labels
    if not words:
        return
    spelled = [tuple(tokenizer(word, add_special_tokens=False)["input_ids"]) for word in words]
    unknown = [
        w for w, ids in zip(words, spelled) if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids
    ]
    if unknown:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the label word(s) {unknown} are not in the base's tokenizer vocabulary (they "
            f"become {tokenizer.unk_token!r}): use words the tokenizer knows.",
        )
    same = [w for i, w in enumerate(words) if spelled[i] in spelled[:i]]
    if same:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the label word(s) {same} have the same tokens as another class's word in the base's "
            "tokenizer, so their targets are one: use words the tokenizer spells apart.",
        )


def calibration_pairs(
    task: Task, tokenizer: Any, n: int, seed: int, *, world: World = SINGLE, rows: Any | None = None
) -> CalibrationBatch:
    """A task's calibration pairs (the first ``n`` rows of its train split after one shuffle with ``seed``;
    this process's part under torchrun) as one batch.

    Raises:
        DatasetInputError: the dataset cannot be read, or has fewer pairs than there are processes.
    """
    rows = load_pair_split(task) if rows is None else rows
    indices = process_calibration_rows(task, len(rows), n, seed, world, "pair(s)")
    return encode_task_pairs(task, tokenizer, [render_pair(task, rows[int(i)]) for i in indices]).batch


def first_pairs(task: Task, tokenizer: Any, n: int) -> CalibrationBatch:
    """The first ``n`` pairs of a task's test split (all of them when it has fewer), as one batch."""
    rows = load_pair_split(task, "test")
    return encode_task_pairs(task, tokenizer, [render_pair(task, rows[i]) for i in range(min(n, len(rows)))]).batch


def base_tokenizer(base_folder: Path) -> Any:
    """The base's tokenizer, padding on the right.

    Raises:
        ModelInputError: when the base has no tokenizer transformers can read, or one without a padding token
            (T5's decoder starts from it).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base_folder))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(
            str(base_folder), f"The base model {base_folder} has no usable tokenizer ({first})."
        ) from None
    if tokenizer.pad_token_id is None:
        raise ModelInputError(
            str(base_folder),
            f"The base model {base_folder}'s tokenizer has no padding token, which a T5 decoder starts from: save the "
            "base's own T5 tokenizer with it.",
        )
    tokenizer.padding_side = "right"
    return tokenizer
