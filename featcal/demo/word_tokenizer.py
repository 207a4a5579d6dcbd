"""The text benchmarks' word-level tokenizers, built in code: one token per word of a fixed vocabulary.

lm5's Llama tokenizer starts every text with ``<s>``; t5x4's T5 tokenizer ends it with ``</s>``, as T5's
does. Both split on whitespace, pad on the right and save with ``save_pretrained``; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TEXT = "$A"  # the text's place in a template


def word_level_tokenizer(
    words: Sequence[str],
    *,
    template: str,
    pad_token: str,
    unk_token: str,
    eos_token: str,
    bos_token: str | None = None,
) -> Any:
    """A fast tokenizer giving each word of ``words`` its index as id, any other word ``unk_token``'s.

    Args:
        words: The vocabulary, in id order (distinct words, the special tokens among them).
        template: Where the special tokens go around a text: ``"<s> $A"`` or ``"$A </s>"``.
        pad_token: The padding token (right padding).
        unk_token: The token of a word outside ``words``.
        eos_token: The end-of-text token.
        bos_token: The start-of-text token, if the tokenizer has one.

    Returns:
        A ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: ``words`` repeats a word, or a token named lacks from it.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words)}
    if len(vocab) != len(words):
        raise ValueError("word_level_tokenizer: the vocabulary repeats a word")
    specials = [token for token in template.split() if token != TEXT]
    missing = [t for t in (*specials, pad_token, unk_token, eos_token, bos_token) if t is not None and t not in vocab]
    if missing:
        raise ValueError(f"word_level_tokenizer: {missing} are not in the vocabulary")
    core = Tokenizer(WordLevel(vocab, unk_token=unk_token))
    core.pre_tokenizer = WhitespaceSplit()
    core.post_processor = TemplateProcessing(single=template, special_tokens=[(t, vocab[t]) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=pad_token, unk_token=unk_token, bos_token=bos_token, eos_token=eos_token,
        padding_side="right",
    )  # fmt: skip
