"""Training the T5 benchmark's models: the base on masked spans, an expert per task from it.

The models are ``transformers.T5ForConditionalGeneration``; inputs and targets are word sequences of the zoo's
word-level vocabulary (:mod:`featcal.demo.t5_tasks`), encoded here word by word with ``</s>`` at the end (as
the tokenizer does) and right-padded per batch. The decoder reads the target shifted right from T5's start
token (teacher forcing), as ``T5ForConditionalGeneration`` does given ``labels``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from featcal.demo.fit import fit
from featcal.families.seq2seq.evaluation import GENERATION


def encode(vocab: dict[str, int], text: str) -> list[int]:
    """The ids of the text's words and ``</s>`` (as the zoo's tokenizer encodes it)."""
    return [*(vocab[word] for word in text.split()), vocab["</s>"]]


def _padded(rows: Sequence[list[int]], fill: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), fill, dtype=torch.long)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = torch.tensor(ids)
    return out


class PairBatches:
    """Encoded (input, target) pairs drawn in random batches.

    Args:
        vocab: The word-level vocabulary.
        pairs: The (input, target) texts.
    """

    def __init__(self, vocab: dict[str, int], pairs: Sequence[tuple[str, str]]) -> None:
        self.pad = vocab["<pad>"]
        self.rows = [(encode(vocab, source), encode(vocab, target)) for source, target in pairs]

    def draw(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A random batch: ``input_ids``, ``attention_mask`` and ``labels`` (-100 beyond each target)."""
        picks = torch.randint(len(self.rows), (size,), generator=generator).tolist()
        ids = _padded([self.rows[i][0] for i in picks], self.pad)
        labels = _padded([self.rows[i][1] for i in picks], -100)
        return ids, (ids != self.pad).long(), labels


def train_t5(
    model: nn.Module,
    batches: PairBatches,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    frozen: Sequence[str] = (),
    desc: str = "training",
    progress: bool = True,
) -> None:
    """The targets' cross-entropy under teacher forcing, trained in place by :func:`~featcal.demo.fit.fit`.

    Args:
        model: A ``T5ForConditionalGeneration``.
        batches: The pairs.
        steps: Optimiser steps.
        batch_size: Pairs per step.
        lr: Peak learning rate.
        seed: Seeds the batches drawn.
        frozen: Parameter-name prefixes that keep their values.
        desc: The progress bar's label.
        progress: Show a progress bar.
    """

    def batch_loss(generator: torch.Generator) -> torch.Tensor:
        ids, mask, labels = batches.draw(batch_size, generator)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    fit(model, batch_loss, steps=steps, lr=lr, seed=seed, frozen=frozen, desc=desc, progress=progress)


@torch.no_grad()
def greedy_exact_match(model: nn.Module, vocab: dict[str, int], pairs: Sequence[tuple[str, str]]) -> float:
    """The share of pairs whose greedy generation (the evaluation's: at most 10 tokens) is exactly the target.

    Args:
        model: A ``T5ForConditionalGeneration`` in eval mode.
        vocab: The word-level vocabulary.
        pairs: (input, target) texts.

    Returns:
        The exact-match rate in [0, 1].
    """
    words = {i: w for w, i in vocab.items()}
    specials = {vocab["<pad>"], vocab["</s>"], vocab["<unk>"]}  # what decoding without special tokens drops
    correct = 0
    for start in range(0, len(pairs), 256):
        chunk = pairs[start : start + 256]
        ids = _padded([encode(vocab, source) for source, _ in chunk], vocab["<pad>"])
        out = model.generate(input_ids=ids, attention_mask=(ids != vocab["<pad>"]).long(), **GENERATION)
        for row, (_, target) in zip(out.tolist(), chunk):
            correct += " ".join(words[t] for t in row if t not in specials) == target
    return correct / max(len(pairs), 1)
