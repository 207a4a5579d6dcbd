"""Greedy generation of a causal LM's responses to rendered prompts, in left-padded batches.

Used by the held-out evaluation (:mod:`featcal.families.causal_lm.evaluation`) and MergeBench's judged safety
(:mod:`featcal.families.causal_lm.mergebench_eval.runner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS


@torch.no_grad()
def greedy_responses(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_length: int,
    max_new_tokens: int,
    batch_size: int,
    stop_ids: Sequence[int] | None = None,
    add_special_tokens: bool = True,
) -> list[str]:
    """The model's greedy response to each prompt (left-padded batches, until a stop token).

    Args:
        model: A ``*ForCausalLM`` in eval mode on its device.
        tokenizer: The base's tokenizer (it must have a pad token).
        prompts: The prompts, as rendered.
        max_length: Prompts are cut to their last this many tokens (a longer one loses its beginning).
        max_new_tokens: The longest response.
        batch_size: Prompts per batch.
        stop_ids: The tokens that end a response (None: the tokenizer's end-of-text token alone).
        add_special_tokens: Whether the tokenizer adds its special tokens (its ``<s>``) to each prompt.

    Returns:
        The responses, decoded without special tokens.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id if stop_ids is None else list(stop_ids),
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = tokenizer(list(prompts[start : start + batch_size]), add_special_tokens=add_special_tokens)
        kept = [ids[-max_length:] for ids in encoded[INPUT_IDS]]
        encoded = tokenizer.pad({INPUT_IDS: kept}, padding=True, padding_side="left", return_tensors="pt")
        ids = encoded[INPUT_IDS].to(device)
        generated = model.generate(input_ids=ids, attention_mask=encoded[ATTENTION_MASK].to(device),
                                   generation_config=config)  # fmt: skip
        out.extend(tokenizer.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True))
    return out
