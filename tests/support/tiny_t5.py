"""Tiny T5s for tests, built in code in a fraction of a second: d_model 64, two encoder and two decoder blocks,
4 heads, a word-level tokenizer over :data:`VOCAB` (T5's ids: pad 0, ``</s>`` 1, unk 2; ``</s>`` ends every
text), and synthetic input/target pairs whose lengths vary (right padding in every batch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

WORDS = [f"w{i}" for i in range(150)]  # more words than the width: the inputs span it
VOCAB = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}


def tiny_config(*, tied: bool = False, attn: str = "eager", gated: bool = True, **overrides: Any):
    """A T5 (FLAN-T5's gated-GELU feed-forward unless ``gated`` is False) of width 64; ``tied``: the LM head
    is the shared embedding (T5 v1.0), else its own (FLAN-T5)."""
    from transformers import T5Config

    options = dict(
        vocab_size=len(VOCAB), d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=tied, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return T5Config(**{**options, **overrides})


def build(state: Mapping[str, torch.Tensor] | None = None, *, seed: int = 0, **config_kw: Any) -> nn.Module:
    """A tiny ``T5ForConditionalGeneration`` (random from ``seed``, or holding ``state``), in eval mode; with an
    LM head of its own unless ``tied``."""
    from transformers import T5ForConditionalGeneration

    config = tiny_config(**config_kw)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    if not config_kw.get("tied", False):  # transformers 5 ties a fresh T5's head: give it its own
        model.lm_head.weight = nn.Parameter(torch.randn(model.lm_head.weight.shape))
    if state is not None:
        model.load_state_dict(dict(state))
    return model


def tokenizer():
    """A word-level fast tokenizer over :data:`VOCAB` that ends every text with ``</s>`` and pads on the right."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    core.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="right"
    )


def pairs(seed: int, count: int = 12) -> list[tuple[str, str]]:
    """Synthetic (input, target) pairs: inputs of 3 to 10 words, targets of 1 to 3."""
    generator = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high + 1, (), generator=generator))
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator).tolist())

    return [(words(3, 10), words(1, 3)) for _ in range(count)]


def encode(batch_pairs: Sequence[tuple[str, str]], extra_padding: int = 0):
    """Pairs as a calibration batch, right-padded to the longest input and target, plus ``extra_padding``
    positions of padding on both (T5's padding id and mask are 0)."""
    from featcal.calibration.adapters import CalibrationBatch
    from featcal.families.seq2seq.texts import encode_pairs

    batch = encode_pairs(tokenizer(), batch_pairs, max_length=64, target_max_length=16).batch
    if not extra_padding:
        return batch

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, extra_padding))

    length = batch.context["attention_mask"].shape[1]
    weights = torch.cat([pad(batch.token_weights[:, :length]), pad(batch.token_weights[:, length:])], dim=1)
    return CalibrationBatch(
        {k: pad(v) for k, v in batch.inputs.items()}, {k: pad(v) for k, v in batch.context.items()}, weights
    )


def save_model(
    folder, seed: int, base: nn.Module | None = None, scale: float = 0.05, *, tok: Any = None, **config_kw: Any
) -> nn.Module:
    """A tiny T5 (random, or ``base`` plus small noise: an expert) saved as a folder with its tokenizer (``tok``,
    by default :func:`tokenizer`; another vocabulary's needs ``vocab_size`` in ``config_kw``)."""
    model = build(seed=seed, **config_kw)
    if base is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q + scale * torch.randn(q.shape, generator=generator))
    model.save_pretrained(folder)
    (tokenizer() if tok is None else tok).save_pretrained(folder)
    return model
