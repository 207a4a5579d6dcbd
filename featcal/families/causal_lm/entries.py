"""What a text task's entry says beyond the common fields: how a row of its dataset becomes a text.

The task table (:mod:`featcal.tasks`) reads the common fields and hands the rest of an entry of this family
to :func:`parse_task_fields`; a calibration data file (:mod:`featcal.data_file`) copies :data:`DATA_FILE`'s
keys of each expert's entry into its task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcal.errors import FeatcalError
from featcal.families.base import DataFileEntries
from featcal.families.causal_lm.answers import answer_rule_problem
from featcal.tasks import DEFAULT_MAX_LENGTH, TextFormat

TASK_FIELDS = frozenset({"text", "prompt", "response", "weigh", "max_length", "answer"})
WEIGHTS = ("all", "response")  # which tokens of a text weigh in the calibration's statistics
# A data file's entry of this family: how a row becomes a text (and its answer); its weighing and length, which
# the file's top level may set for every entry. The family of an entry that says nothing of another's.
DATA_FILE = DataFileEntries(keys=("text", "prompt", "response", "answer"), defaults=("weigh", "max_length"))


def parse_task_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A text task's :class:`~featcal.tasks.TextFormat`, checked.

    Args:
        entry: The task's entry in a tasks file (or a data file's expert, as a task entry).
        where: The entry named for messages.

    Returns:
        ``text``: the task's text format.

    Raises:
        FeatcalError: naming the entry, for a format that does not say how a row becomes a text, a ``weigh``,
            ``max_length`` or ``answer`` that does not fit.
    """
    values = {key: entry.get(key) for key in ("text", "prompt", "response")}
    not_text = sorted(k for k, v in values.items() if v is not None and (not isinstance(v, str) or not v.strip()))
    if not_text:
        raise FeatcalError(f"{where}: {', '.join(map(repr, not_text))} must be a column name or a template (text).")
    weigh = entry.get("weigh", "all")
    if weigh not in WEIGHTS:
        raise FeatcalError(f"{where}: 'weigh' must be one of {', '.join(WEIGHTS)}, not {weigh!r}.")
    text, prompt, response = values["text"], values["prompt"], values["response"]
    if text is not None and (prompt is not None or response is not None):
        raise FeatcalError(f"{where}: give 'text', or 'prompt' and 'response', not both.")
    if text is None and (prompt is None or response is None):
        raise FeatcalError(
            f"{where}: say how a row becomes a text: 'text' (a column or a template such as "
            "'{query}\\n{response}'), or 'prompt' and 'response'."
        )
    if weigh == "response" and text is not None:
        raise FeatcalError(f"{where}: 'weigh: response' needs 'prompt' and 'response' (which part is the response).")
    max_length = entry.get("max_length", DEFAULT_MAX_LENGTH)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise FeatcalError(f"{where}: 'max_length' must be a whole number of tokens, at least 2, not {max_length!r}.")
    answer = entry.get("answer")
    if answer is not None:
        if not isinstance(answer, str) or text is not None:
            raise FeatcalError(
                f"{where}: 'answer' (line, boxed or a pattern with one group) needs 'prompt' and 'response'."
            )
        problem = answer_rule_problem(answer)
        if problem is not None:
            raise FeatcalError(f"{where}: {problem}.")
    return {"text": TextFormat(text, prompt, response, weigh, max_length, answer)}
