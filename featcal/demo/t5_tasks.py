"""The T5 benchmark's synthetic text-to-text tasks: classification-like, each target one label word, as GLUE's.

Every text is words separated by single spaces; a word-level tokenizer (:func:`t5_tokenizer`) gives each word
one token and ends a text with ``</s>``, as T5's does. A task's input is its verb, ``:``, then the row's
sentence (the data file's ``input`` template); its target the word of the row's class (``labels``, in class
order). Three tasks ask about the same kind of sentence, a short review made of filler words, one or two nouns
of one topic, one word of time and one or three words of opinion (``we soup yesterday good was``):

- ``sentiment``: the opinion most of its opinion words give, ``negative`` or ``positive``;
- ``topic``: what its nouns are about, ``sport``, ``food`` or ``music``;
- ``tense``: when, by its word of time, ``past`` or ``future``;

and the fourth about two lists of one to three letters around ``|`` (``c a f | c a f``):

- ``match``: ``yes`` when they are the same list, else ``no`` (the second differs from the first in one
  letter).

So an input's verb alone tells which question to answer, and the four answer with eleven different words. The
base never sees a task: its pretraining pairs (:func:`generic_pairs`) are sentences over every word of the
tasks (label words included) with a span replaced by ``<x>`` in the input and the span as the target, and
never hold a task's verb or ``:``. This module imports no torch.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids: padding (the decoder's start) 0, end of text 1, unknown 2
MASK = "<x>"  # the pretraining's masked span
SEPARATOR = "|"
FILLER = (
    "the", "an", "this", "that", "my", "our", "one", "some", "was", "is", "felt", "looked", "very", "quite",
    "really", "so", "and", "but", "indeed", "again", "here", "there", "we", "they", "it", "with",
)  # fmt: skip
OPINIONS = {
    "negative": ("bad", "sad", "awful", "poor", "ugly", "dull", "grim", "weak"),
    "positive": ("good", "great", "happy", "nice", "fine", "lovely", "bright", "warm"),
}
TOPICS = {
    "sport": ("ball", "goal", "team", "race", "coach", "pitch", "runner", "score"),
    "food": ("bread", "soup", "apple", "rice", "cake", "cheese", "salad", "pie"),
    "music": ("song", "drum", "piano", "band", "tune", "guitar", "choir", "violin"),
}
TIMES = {
    "past": ("yesterday", "before", "once", "earlier", "lately", "formerly"),
    "future": ("tomorrow", "soon", "later", "next", "someday", "tonight"),
}
LETTERS = tuple("abcdefghijklmnop")
MATCH_LENGTHS = (1, 3)  # letters in each of match's lists, at least and at most


@dataclass(frozen=True)
class T5Task:
    """One synthetic task: its verb (the input's first word), its label words and how a row is drawn.

    Attributes:
        name: The task's name (the expert's folder, the data file's task).
        verb: The word every input of the task starts with.
        labels: The words of the classes, in class order (the data file's ``labels``).
        draw: ``draw(rng)`` gives a row's sentence and its class id.
    """

    name: str
    verb: str
    labels: tuple[str, ...]
    draw: Callable[[random.Random], tuple[str, int]]

    @property
    def input_template(self) -> str:
        """The data file's ``input`` template over a row's ``sentence``."""
        return f"{self.verb} : {{sentence}}"

    def pair(self, row: dict[str, str | int]) -> tuple[str, str]:
        """A row (``sentence``, ``label``) as its (input, target) pair, as the data file's templates render it."""
        return self.input_template.format(sentence=row["sentence"]), self.labels[int(row["label"])]


def _review(rng: random.Random) -> tuple[list[str], dict[str, int]]:
    """A review: its words, and the class of each of its attributes (``topic`` in :data:`TOPICS`, ``opinion``
    in :data:`OPINIONS`, ``time`` in :data:`TIMES`)."""
    classes = {
        "topic": rng.randrange(len(TOPICS)),
        "opinion": rng.randrange(len(OPINIONS)),
        "time": rng.randrange(len(TIMES)),
    }
    majority = list(OPINIONS.values())[classes["opinion"]]
    minority = list(OPINIONS.values())[1 - classes["opinion"]]
    words = [rng.choice(FILLER) for _ in range(rng.randint(1, 3))]
    words += [rng.choice(list(TOPICS.values())[classes["topic"]]) for _ in range(rng.randint(1, 2))]
    words.append(rng.choice(list(TIMES.values())[classes["time"]]))
    if rng.random() < 0.5:
        words.append(rng.choice(majority))
    else:
        words += [rng.choice(majority), rng.choice(majority), rng.choice(minority)]
    rng.shuffle(words)
    return words, classes


def _attribute(name: str) -> Callable[[random.Random], tuple[str, int]]:
    """Draws a review, classed by its attribute ``name``."""

    def draw(rng: random.Random) -> tuple[str, int]:
        words, classes = _review(rng)
        return " ".join(words), classes[name]

    return draw


def _match(rng: random.Random) -> tuple[str, int]:
    first = [rng.choice(LETTERS) for _ in range(rng.randint(*MATCH_LENGTHS))]
    second, same = list(first), rng.randrange(2)
    if not same:
        at = rng.randrange(len(second))
        second[at] = rng.choice([letter for letter in LETTERS if letter != first[at]])
    return " ".join([*first, SEPARATOR, *second]), same


T5_TASKS = (
    T5Task("sentiment", "sentiment", tuple(OPINIONS), _attribute("opinion")),
    T5Task("topic", "topic", tuple(TOPICS), _attribute("topic")),
    T5Task("tense", "tense", tuple(TIMES), _attribute("time")),
    T5Task("match", "match", ("no", "yes"), _match),
)
T5_TASKS_BY_NAME = {task.name: task for task in T5_TASKS}
LABEL_WORDS = tuple(dict.fromkeys(word for task in T5_TASKS for word in task.labels))
CONTENT_WORDS = (
    *FILLER, *(w for words in OPINIONS.values() for w in words), *(w for words in TOPICS.values() for w in words),
    *(w for words in TIMES.values() for w in words), *LETTERS, SEPARATOR, *LABEL_WORDS,
)  # fmt: skip


def vocabulary() -> list[str]:
    """Every word of every text, T5's special tokens first (their ids 0, 1, 2), then the mask, the verbs and
    ``:``, then the words of the sentences and the label words."""
    return [*SPECIALS, MASK, *(task.verb for task in T5_TASKS), ":", *CONTENT_WORDS]


def task_rows(task: T5Task, rng: random.Random, count: int) -> list[dict[str, str | int]]:
    """``count`` rows of ``task``: ``{"sentence": ..., "label": class id}``, each class about equally often."""
    rows: list[dict[str, str | int]] = []
    for _ in range(count):
        sentence, label = task.draw(rng)
        rows.append({"sentence": sentence, "label": label})
    return rows


def _generic_sentence(rng: random.Random) -> list[str]:
    """A sentence of the pretraining: a review (half of them with a label word added), letters, or random
    words of the tasks."""
    kind = rng.randrange(3)
    if kind == 0:
        words = _review(rng)[0]
        return words + [rng.choice(LABEL_WORDS)] if rng.random() < 0.5 else words
    if kind == 1:
        return [rng.choice(LETTERS) for _ in range(rng.randint(3, 8))]
    return [rng.choice(CONTENT_WORDS) for _ in range(rng.randint(3, 8))]


def generic_pairs(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """The base's pretraining pairs: a sentence with a span of one to three words replaced by ``<x>``, and
    the span; over every word of the tasks, never a task's verb or ``:``."""
    pairs = []
    for _ in range(count):
        words = _generic_sentence(rng)
        length = rng.randint(1, min(3, len(words) - 1))
        start = rng.randrange(len(words) - length + 1)
        masked = [*words[:start], MASK, *words[start + length :]]
        pairs.append((" ".join(masked), " ".join(words[start : start + length])))
    return pairs


def t5_tokenizer():
    """The zoo's word-level fast tokenizer: whitespace split, ``</s>`` after every text, T5's special ids.

    Returns:
        A ``PreTrainedTokenizerFast`` (right padding; its padding token is the decoder's start, as T5's).
    """
    from featcal.demo.word_tokenizer import word_level_tokenizer

    return word_level_tokenizer(
        vocabulary(), template="$A </s>", pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
