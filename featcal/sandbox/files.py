"""The JSONL files of code evaluation: problems in the HumanEval+ format, and the completions to score.

A problems file holds one JSON object a line with ``task_id``, ``prompt``, ``test`` and (optionally,
null for an MBPP+-style test that asserts by itself) ``entry_point``; other keys (``canonical_solution``,
``base_input``...) are ignored. A completions file holds one sample a line, ``{"task_id": ...,
"completion": ...}`` (the format of human-eval's samples files), the samples of a problem
in the order of their lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from featcal.errors import InputError
from featcal.sandbox.scoring import Problem


def _records(path: str | Path, kind: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each line's JSON object with its line number; blank lines are skipped."""
    file = Path(path)
    if not file.is_file():
        raise InputError(path, f"The {kind} {path} is not a file: give the path of a JSONL file.")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(path, f"The {kind} {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8.") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(path, f"{path} line {number} is not JSON ({exc.msg}): write one object a line.") from None
        if not isinstance(record, dict):
            raise InputError(path, f"{path} line {number} is not a JSON object: write one object a line.")
        yield number, record


def _text(record: dict[str, Any], key: str, path: str | Path, number: int, *, optional: bool = False) -> str | None:
    value = record.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InputError(path, f"{path} line {number}: {key!r} must be a string, not {type(value).__name__}.")
    return value


def read_problems(path: str | Path) -> list[Problem]:
    """The problems of a HumanEval+-format JSONL file.

    Args:
        path: The file.

    Returns:
        Its problems, in its order.

    Raises:
        InputError: for a missing or non-UTF-8 file, a line that is not a JSON object, a missing or
            non-string field, a repeated ``task_id``, or no problem at all; naming the line.
    """
    problems: dict[str, Problem] = {}
    for number, record in _records(path, "problems file"):
        task_id = _text(record, "task_id", path, number)
        if task_id in problems:
            raise InputError(path, f"{path} line {number}: task_id {task_id!r} appears twice: keep one.")
        problems[task_id] = Problem(
            task_id,
            _text(record, "prompt", path, number),
            _text(record, "test", path, number),
            _text(record, "entry_point", path, number, optional=True),
        )
    if not problems:
        raise InputError(path, f"The problems file {path} holds no problem: give one JSON object a line.")
    return list(problems.values())


def read_completions(path: str | Path) -> dict[str, list[str]]:
    """The samples of a completions JSONL file, by ``task_id``.

    Args:
        path: The file.

    Returns:
        Each problem's completions, in the file's order.

    Raises:
        InputError: for a missing or non-UTF-8 file, a line that is not a JSON object, or a missing or
            non-string ``task_id`` or ``completion``; naming the line.
    """
    completions: dict[str, list[str]] = {}
    for number, record in _records(path, "completions file"):
        task_id = _text(record, "task_id", path, number)
        completions.setdefault(task_id, []).append(_text(record, "completion", path, number))
    return completions


def check_completions(
    problems: list[Problem], completions: dict[str, list[str]], k: int, problems_path: str, completions_path: str
) -> None:
    """Refuse completions files that do not fit the problems: a ``task_id`` of no problem, or a problem
    with fewer than ``k`` samples.

    Args:
        problems: The problems read from ``problems_path``.
        completions: The samples read from ``completions_path``.
        k: The k of pass@k.
        problems_path: The problems file, for messages.
        completions_path: The completions file, for messages.

    Raises:
        InputError: naming the completions file, the task id and the fix.
    """
    ids = {problem.task_id for problem in problems}
    unknown = [task for task in completions if task not in ids]
    if unknown:
        raise InputError(
            completions_path,
            f"{completions_path} holds completions of task_ids that no problem of {problems_path} has: "
            f"{', '.join(map(repr, unknown[:5]))}{' …' if len(unknown) > 5 else ''}; fix or remove those lines.",
        )
    for problem in problems:
        count = len(completions.get(problem.task_id, ()))
        if count < k:
            raise InputError(
                completions_path,
                f"{completions_path} holds {count} completion(s) of {problem.task_id!r}; pass@{k} needs at least "
                f"{k} of each problem: generate more samples, or lower `k`.",
            )
