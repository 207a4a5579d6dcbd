"""The language-model benchmark's synthetic tasks: short symbol sequences with one exact answer each.

Every text is words separated by single spaces: a task's verb, its input, ``=``, then the answer. A
word-level tokenizer (:func:`lm_tokenizer`) gives each word one token, so a tiny model learns the tasks
in a few hundred steps. The tasks:

- ``add``: a digit and a number of one or two digits, written digit by digit, and their sum
  (``add 7 + 5 8 = 6 5``);
- ``reverse``: letters, reversed (``rev c a f = f a c``);
- ``cipher``: letters, each replaced by a fixed substitution of the alphabet drawn from the zoo's seed
  (``enc c a f = q m x``);
- ``brackets``: opening brackets, closed in the right order (``brk ( [ < = > ] )``);
- ``format``: letters, written as a bracketed list (``fmt c a f = [ c , a , f ]``).

The base never sees an answer: its pretraining text (:func:`generic_text`) is random sequences of the
same words and each task's prompt followed by random words of the answer's length. This module imports
no torch.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

LETTERS = tuple("abcdefghijklmnop")
DIGITS = tuple("0123456789")
OPENERS = ("(", "[", "{", "<")
CLOSERS = {"(": ")", "[": "]", "{": "}", "<": ">"}
PUNCTUATION = ("=", "+", ",", *OPENERS, *CLOSERS.values())
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class LMTask:
    """One synthetic task: its verb (the prompt's first word) and how a row is drawn.

    Attributes:
        name: The task's name (the expert's folder, the data file's task).
        verb: The word every prompt of the task starts with.
        draw: ``draw(rng, cipher, min_len, max_len)`` gives the input words and the answer words.
    """

    name: str
    verb: str
    draw: Callable[[random.Random, dict[str, str], int, int], tuple[list[str], list[str]]]


def _letters(rng: random.Random, low: int, high: int) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(low, high))]


def _add(rng: random.Random, cipher: dict[str, str], low: int, high: int) -> tuple[list[str], list[str]]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return [*str(a), "+", *str(b)], list(str(a + b))


def _reverse(rng: random.Random, cipher: dict[str, str], low: int, high: int) -> tuple[list[str], list[str]]:
    words = _letters(rng, low, high)
    return words, words[::-1]


def _cipher(rng: random.Random, cipher: dict[str, str], low: int, high: int) -> tuple[list[str], list[str]]:
    words = _letters(rng, low, high)
    return words, [cipher[w] for w in words]


def _brackets(rng: random.Random, cipher: dict[str, str], low: int, high: int) -> tuple[list[str], list[str]]:
    words = [rng.choice(OPENERS) for _ in range(rng.randint(low, high))]
    return words, [CLOSERS[w] for w in reversed(words)]


def _format(rng: random.Random, cipher: dict[str, str], low: int, high: int) -> tuple[list[str], list[str]]:
    words = _letters(rng, low, high)
    listed = [part for w in words for part in (w, ",")][:-1]
    return words, ["[", *listed, "]"]


LM_TASKS = (
    LMTask("add", "add", _add),
    LMTask("reverse", "rev", _reverse),
    LMTask("cipher", "enc", _cipher),
    LMTask("brackets", "brk", _brackets),
    LMTask("format", "fmt", _format),
)
TASKS_BY_NAME = {task.name: task for task in LM_TASKS}


def vocabulary() -> list[str]:
    """Every word of every text, special tokens first."""
    return [*SPECIALS, *(t.verb for t in LM_TASKS), *GENERIC_VERBS, *LETTERS, *DIGITS, *PUNCTUATION]


def substitution(seed: int) -> dict[str, str]:
    """The cipher task's substitution of the letters: a permutation without fixed points, from ``seed``."""
    rng = random.Random(f"cipher-{seed}")
    while True:
        shuffled = list(LETTERS)
        rng.shuffle(shuffled)
        if all(a != b for a, b in zip(LETTERS, shuffled)):
            return dict(zip(LETTERS, shuffled))


def task_rows(
    task: LMTask, rng: random.Random, count: int, cipher: dict[str, str], min_len: int, max_len: int
) -> list[dict[str, str]]:
    """``count`` rows of ``task``: ``{"prompt": "<verb> <input> =", "answer": "<answer>"}``."""
    rows = []
    for _ in range(count):
        words, answer = task.draw(rng, cipher, min_len, max_len)
        rows.append({"prompt": " ".join([task.verb, *words, "="]), "answer": " ".join(answer)})
    return rows


# the generic text's own instructions, in the tasks' format ("<verb> <input> = <answer>"): the base learns
# the format of a question and its answer, and none of the tasks' answers
GENERIC_VERBS: dict[str, Callable[[list[str]], list[str]]] = {
    "cpy": lambda words: words,
    "fst": lambda words: words[:1],
    "lst": lambda words: words[-1:],
    "dup": lambda words: [w for word in words for w in (word, word)],
}
GENERIC_KINDS = 7


def _generic_line(rng: random.Random, kind: int, max_len: int) -> list[str]:
    """One line of generic text of ``kind`` (0 to ``GENERIC_KINDS`` - 1)."""
    words = [*LETTERS, *DIGITS, *PUNCTUATION, *(t.verb for t in LM_TASKS)]
    span = [rng.choice(LETTERS) for _ in range(rng.randint(2, max_len))]
    if kind == 0:  # a span, then the same span again
        return span + [rng.choice(words) for _ in range(rng.randint(0, 2))] + span
    if kind == 1:  # a span, then the span mirrored
        return span + [rng.choice(words) for _ in range(rng.randint(0, 2))] + span[::-1]
    if kind == 2:  # nested brackets around letters
        out: list[str] = []
        stack: list[str] = []
        for _ in range(rng.randint(2, 2 * max_len)):
            if stack and rng.random() < 0.4:
                out.append(CLOSERS[stack.pop()])
            elif rng.random() < 0.5:
                stack.append(rng.choice(OPENERS))
                out.append(stack[-1])
            else:
                out.append(rng.choice(LETTERS))
        return out + [CLOSERS[o] for o in reversed(stack)]
    if kind == 3:  # a bracketed list
        listed = [part for w in span for part in (w, ",")][:-1]
        return ["[", *listed, "]"] if rng.random() < 0.5 else listed
    if kind == 4:  # a run of the alphabet or of the digits
        alphabet = rng.choice((LETTERS, DIGITS))
        first = rng.randrange(len(alphabet))
        return [alphabet[(first + k) % len(alphabet)] for k in range(rng.randint(3, 2 * max_len))]
    if kind == 5:  # a generic instruction and its answer
        verb = rng.choice(list(GENERIC_VERBS))
        items = [rng.choice(rng.choice((LETTERS, DIGITS, OPENERS))) for _ in range(rng.randint(2, max_len))]
        return [verb, *items, "=", *GENERIC_VERBS[verb](items)]
    return [rng.choice(words) for _ in range(rng.randint(3, 2 * max_len))]


def generic_text(rng: random.Random, count: int, max_len: int) -> list[str]:
    """The base's pretraining text: lines that repeat a span or mirror it, nested brackets, lists, runs of
    the alphabet or the digits and random words, over every word of the tasks; never a task's prompt."""
    return [" ".join(_generic_line(rng, index % GENERIC_KINDS, max_len)) for index in range(count)]


def lm_tokenizer():
    """The zoo's word-level fast tokenizer: whitespace split, ``<s>`` before every text, ``</s>`` its end.

    Returns:
        A ``PreTrainedTokenizerFast`` (right padding).
    """
    from featcal.demo.word_tokenizer import word_level_tokenizer

    return word_level_tokenizer(
        vocabulary(), template="<s> $A", pad_token="<pad>", unk_token="<unk>", eos_token="</s>", bos_token="<s>"
    )
