"""The calibration's view of a decoder-only causal LM of transformers 5: Llama, Mistral, Qwen2, Qwen3, Gemma-2.

Layer 0's input is the token embedding (Gemma-2's scaling is inside its embedding module). Each layer
runs with its batch's context: the causal mask built from the examples' padding (a sliding-window
mask for the layers that have one), the positions and the rotary embeddings, all made by the model's
own functions, so that the chain of layers equals the model's own forward. Per layer the RMSNorms,
q/k/v (one group: they read one input), ``o_proj``, gate/up (one group) and ``down_proj`` are solved;
Qwen3's per-head ``q_norm``/``k_norm`` keep their merged values, as do the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, Normalization, TokenWeighting

INPUT_IDS = "input_ids"  # the stem's input
ATTENTION_MASK = "attention_mask"  # 1 for a token, 0 for padding: what every layer's mask is built from
FULL, SLIDING = "full_attention", "sliding_attention"
# The solved submodules of a decoder layer, by name; Gemma-2 adds its two feed-forward norms.
CALIBRATED = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class _Stem(nn.Module):
    """The token embedding: the input of decoder layer 0."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


@dataclass(frozen=True)
class DecoderContext:
    """What every layer of one forward batch reads: its attention masks by layer type, the positions and
    the rotary embeddings ``(cos, sin)``."""

    masks: dict[str, Any]
    positions: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]


def _rms_normalize(eps: float):
    """An RMSNorm's normalisation without its scale, in float32 as transformers computes it."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    return normalize


def _layer_type(layer: nn.Module) -> str:
    """Which of a batch's masks a decoder layer reads. transformers 5 keeps the type on the layer's
    attention (``self_attn.layer_type``: Qwen2/3, Gemma-2), not on the decoder layer; layers without one
    (Llama, Mistral) read the full-attention mask, which for Mistral is its sliding-window one."""
    attention = getattr(layer, "self_attn", None)
    return getattr(attention, "layer_type", None) or getattr(layer, "attention_type", None) or FULL


class DecoderAdapter:
    """A ``*ForCausalLM`` of transformers 5 whose decoder is ``model.model`` (see the module docstring).

    Checkpoint keys are the ``ForCausalLM``'s own (``model.layers.0.self_attn.q_proj.weight``).
    """

    def tower(self, model: nn.Module) -> nn.Module:
        return model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def stem(self, model: nn.Module) -> nn.Module:
        return _Stem(model.model.embed_tokens)

    def stem_parts(self) -> dict[str, str]:
        return {"embed_tokens": "model.embed_tokens."}

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        return stem(batch.inputs[INPUT_IDS])

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> DecoderContext:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = model.config
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        attention_mask = batch.context.get(ATTENTION_MASK)
        kwargs = {
            "config": config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            "cache": None,
            "position_ids": positions,
        }
        types = set(getattr(config, "layer_types", None) or [FULL])
        masks: dict[str, Any] = {}
        if FULL in types:  # Mistral's layers have no type, and slide all when it has a window
            sliding_everywhere = config.model_type == "mistral" and getattr(config, "sliding_window", None)
            builder = create_sliding_window_causal_mask if sliding_everywhere else create_causal_mask
            masks[FULL] = builder(**kwargs)
        if SLIDING in types:
            masks[SLIDING] = create_sliding_window_causal_mask(**kwargs)
        return DecoderContext(masks, positions, model.model.rotary_emb(hidden, positions))

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: DecoderContext) -> torch.Tensor:
        mask = context.masks[_layer_type(layer)]
        out = layer(hidden, attention_mask=mask, position_ids=context.positions, position_embeddings=context.rotary)
        return out[0] if isinstance(out, tuple) else out

    def head(self, model: nn.Module) -> nn.Module:
        return model.model.norm

    def head_prefix(self) -> str:
        return "model.norm."

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch) -> torch.Tensor:
        """The final norm of each example's last token (the one the next token is predicted from)."""
        mask = batch.context.get(ATTENTION_MASK)
        last = (
            torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
            if mask is None
            else mask.to(hidden.device).sum(1) - 1
        )
        return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        modules = dict(layer.named_modules())
        return {name: modules[name] for name in CALIBRATED if name in modules}

    def normalization(self, module: nn.Module) -> Normalization | None:
        if isinstance(module, nn.Linear):
            return None
        kind = type(module).__name__
        if not kind.endswith("RMSNorm"):
            raise TypeError(f"{kind} is neither an nn.Linear nor an RMSNorm")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        # Gemma's RMSNorm scales by (1 + weight), its weight starting at zero.
        return Normalization(_rms_normalize(float(eps)), has_bias=False, scale_offset=1.0 if "Gemma" in kind else 0.0)

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        return TokenWeighting("ones", None)  # padding weighs 0 through the batch's own token weights
