"""The one answer of a language task's response, where it has one: how it is found and compared.

A text task says in its ``answer`` entry how a response's answer is found (:func:`answer_rule_problem`
checks it): ``line`` (the response's first non-empty line), ``boxed`` (the content of its first
``\\boxed{...}``, braces balanced, as math solutions write their result), or a regular expression with
one group (the group of its first match). The evaluation's exact match compares the answer found in the
model's greedy response with the one found in the reference response, both normalised
(:func:`normalize_answer`); a reference in which none is found is not counted. This module imports
neither torch nor transformers.
"""

from __future__ import annotations

import re

LINE, BOXED = "line", "boxed"
BOXED_MARK = "\\boxed{"


def answer_rule_problem(rule: str) -> str | None:
    """What is wrong with an ``answer`` entry, in words; None when it is a rule.

    Args:
        rule: ``line``, ``boxed`` or a regular expression with exactly one group.

    Returns:
        None, or the problem (a pattern that does not compile, or has another number of groups).
    """
    if rule in (LINE, BOXED):
        return None
    try:
        groups = re.compile(rule).groups
    except re.error as exc:
        return f"'answer' {rule!r} is neither 'line', 'boxed' nor a regular expression ({exc})"
    if groups != 1:
        return f"'answer' {rule!r} must have exactly one group, the answer (it has {groups})"
    return None


def _first_boxed(text: str) -> str | None:
    start = text.find(BOXED_MARK)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED_MARK)
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None  # unbalanced: the response was cut inside the box


def extract_answer(rule: str, text: str) -> str | None:
    """The answer ``rule`` finds in ``text``, or None when it finds none.

    Args:
        rule: ``line``, ``boxed`` or a regular expression with one group (checked beforehand).
        text: A response.

    Returns:
        The answer as it stands in the text (not normalised), or None.
    """
    if rule == LINE:
        return next((line for line in text.splitlines() if line.strip()), None)
    if rule == BOXED:
        return _first_boxed(text)
    match = re.search(rule, text)
    return None if match is None else match.group(1)


def normalize_answer(answer: str) -> str:
    """An answer made comparable: surrounding space, ``$`` and a final full stop dropped, runs of white
    space made one space, letters in lower case (``" $\\frac{1}{2}$. "`` gives ``"\\frac{1}{2}"``).

    Args:
        answer: An answer found by :func:`extract_answer`.

    Returns:
        The normalised answer.
    """
    text = " ".join(answer.split()).strip().rstrip(".").strip().strip("$").strip()
    return text.lower()
