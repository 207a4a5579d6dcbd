"""The one answer of a language task's response: found by the task's rule, compared after normalisation."""

from __future__ import annotations

import pytest

from featcal.errors import FeatcalError
from featcal.families.causal_lm.answers import answer_rule_problem, extract_answer, normalize_answer
from featcal.families.causal_lm.evaluation import exact_matches
from featcal.tasks import parse_task_table


def test_answers_are_found_by_line_boxed_or_a_pattern() -> None:
    assert extract_answer("line", "\n\n  42 \nmore") == "  42 "
    assert extract_answer("boxed", "so $x = \\boxed{\\frac{1}{2}}$ and \\boxed{7}") == "\\frac{1}{2}"
    assert extract_answer("boxed", "cut off \\boxed{\\frac{1}") is None and extract_answer("boxed", "none") is None
    assert extract_answer(r"answer is:? (\S+)", "The answer is: 12.") == "12."
    assert (
        normalize_answer(" $\\frac{1}{2}$. ") == "\\frac{1}{2}" and normalize_answer("Paris  France") == "paris france"
    )


def test_exact_match_counts_only_references_with_an_answer() -> None:
    responses = ["so \\boxed{4}", "\\boxed{ 5 }.", "no answer", "\\boxed{9}"]
    references = ["2+2 = \\boxed{4}", "\\boxed{5}", "\\boxed{6}", "no box here"]
    assert exact_matches("boxed", responses, references) == (2, 3)


@pytest.mark.parametrize(
    "rule, message",
    [("(a)(b)", "exactly one group"), ("([", "neither 'line', 'boxed' nor a regular expression"), (3, "needs")],
)
def test_a_bad_answer_rule_is_named(rule, message) -> None:
    entry = {"family": "causal_lm", "dataset": "d.jsonl", "prompt": "{q}", "response": "{r}", "answer": rule}
    with pytest.raises(FeatcalError, match=message):
        parse_task_table({"tasks": {"t": entry}})
    assert answer_rule_problem("boxed") is None and answer_rule_problem(r"=(\d+)") is None
