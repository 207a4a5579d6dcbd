"""A small byte-level BPE ``CLIPTokenizer`` built in code from the benchmark's own captions.

The vocabulary holds the 256 byte symbols (alone and as word ends), the two CLIP special tokens,
and one merge chain per word of the corpus, so each caption word becomes one or a few tokens and
any other text still tokenizes (byte by byte). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"


def _words(corpus: Iterable[str]) -> list[str]:
    """The distinct pre-tokenized, byte-mapped words of ``corpus``, as CLIP's tokenizer splits them."""
    probe = CLIPTokenizer(vocab={BOS: 0, EOS: 1}, merges=[])
    backend = probe.backend_tokenizer
    words: set[str] = set()
    for text in corpus:
        normalized = backend.normalizer.normalize_str(text)
        words.update(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return sorted(words)


def build_tokenizer(corpus: Iterable[str], *, model_max_length: int = 77) -> CLIPTokenizer:
    """A ``CLIPTokenizer`` whose merges spell every word of ``corpus``; saves with ``save_pretrained``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for symbol in alphabet + [s + END_OF_WORD for s in alphabet]:
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    known: set[tuple[str, str]] = set()
    for word in _words(corpus):
        symbols = list(word)
        symbols[-1] += END_OF_WORD
        current = symbols[0]
        for symbol in symbols[1:]:
            pair = (current, symbol)
            current += symbol
            if pair not in known:
                known.add(pair)
                merges.append(pair)
            vocab.setdefault(current, len(vocab))
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
