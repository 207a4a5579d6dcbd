"""Training the language-model benchmark's models: the base on generic text, an expert per task from it.

The models are ``transformers.LlamaForCausalLM``; texts are word sequences of the zoo's word-level
vocabulary (:mod:`featcal.demo.lm_tasks`), encoded here word by word (as the tokenizer does) and padded
per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from featcal.demo.fit import fit


def encode(vocab: dict[str, int], text: str) -> list[int]:
    """``<s>`` and the ids of the text's words (as the zoo's tokenizer encodes it)."""
    return [vocab["<s>"], *(vocab[word] for word in text.split())]


class TextBatches:
    """Encoded texts drawn in random batches: ids, attention mask and the labels of the scored tokens.

    Args:
        vocab: The word-level vocabulary.
        texts: ``(prompt, response)`` pairs; with ``responses_only`` only the response's tokens (and the
            ``</s>`` after it) are scored, else every token after ``<s>``.
        responses_only: Score the responses alone.
        end_of_text: Append ``</s>`` to every text.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        texts: Sequence[tuple[str, str]],
        *,
        responses_only: bool,
        end_of_text: bool,
    ) -> None:
        self.pad = vocab["<pad>"]
        self.rows: list[tuple[list[int], int]] = []
        for prompt, response in texts:
            ids = encode(vocab, f"{prompt} {response}".strip())
            if end_of_text:
                ids.append(vocab["</s>"])
            first = len(encode(vocab, prompt)) if responses_only else 1
            self.rows.append((ids, first))

    def draw(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A random batch: ``input_ids``, ``attention_mask`` and ``labels`` (-100 where not scored)."""
        picks = torch.randint(len(self.rows), (size,), generator=generator).tolist()
        length = max(len(self.rows[i][0]) for i in picks)
        ids = torch.full((size, length), self.pad, dtype=torch.long)
        labels = torch.full((size, length), -100, dtype=torch.long)
        for row, index in enumerate(picks):
            tokens, first = self.rows[index]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, first : len(tokens)] = torch.tensor(tokens[first:])
        return ids, (ids != self.pad).long(), labels


def train_lm(
    model: nn.Module,
    batches: TextBatches,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    frozen: Sequence[str] = (),
    desc: str = "training",
    progress: bool = True,
) -> None:
    """Next-token cross-entropy on the batches' scored tokens, trained in place by :func:`~featcal.demo.fit.fit`.

    Args:
        model: A ``*ForCausalLM``.
        batches: The texts.
        steps: Optimiser steps.
        batch_size: Texts per step.
        lr: Peak learning rate.
        seed: Seeds the batches drawn.
        frozen: Parameter-name prefixes that keep their values.
        desc: The progress bar's label.
        progress: Show a progress bar.
    """

    def batch_loss(generator: torch.Generator) -> torch.Tensor:
        ids, mask, labels = batches.draw(batch_size, generator)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)

    fit(model, batch_loss, steps=steps, lr=lr, seed=seed, frozen=frozen, desc=desc, progress=progress)


@torch.no_grad()
def greedy_exact_match(
    model: nn.Module, vocab: dict[str, int], rows: Sequence[dict[str, str]], *, max_new_tokens: int
) -> float:
    """The share of rows whose greedy answer (until ``</s>``) is exactly the row's answer.

    Args:
        model: A ``*ForCausalLM`` in eval mode.
        vocab: The word-level vocabulary.
        rows: ``{"prompt", "answer"}`` rows.
        max_new_tokens: The longest answer generated.

    Returns:
        The exact-match rate in [0, 1].
    """
    words = {i: w for w, i in vocab.items()}
    end, pad = vocab["</s>"], vocab["<pad>"]
    correct = 0
    for start in range(0, len(rows), 256):
        chunk = rows[start : start + 256]
        prompts = [encode(vocab, row["prompt"]) for row in chunk]
        length = max(map(len, prompts))
        ids = torch.full((len(chunk), length), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p)  # left padding
        mask = (ids != pad).long()
        out: list[list[int]] = [[] for _ in chunk]
        done = torch.zeros(len(chunk), dtype=torch.bool)
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            nxt = logits.argmax(-1)
            for i, token in enumerate(nxt.tolist()):
                if not done[i]:
                    if token == end:
                        done[i] = True
                    else:
                        out[i].append(token)
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
        for row, tokens in zip(chunk, out):
            correct += " ".join(words[t] for t in tokens) == row["answer"]
    return correct / max(len(rows), 1)
