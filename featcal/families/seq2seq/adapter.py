"""The calibration's view of a T5 encoder-decoder (``T5ForConditionalGeneration`` of transformers 5: T5, FLAN-T5).

The calibrated layers are the encoder's blocks, in order, then the decoder's. A stream's hidden states are
``[encoder positions | decoder positions]`` along the sequence: the stem embeds the input tokens and the
decoder's input tokens (the target shifted right: teacher forcing) with the stream's own embedding; an
encoder block runs on the first part and leaves the second as it is; the last encoder block also applies
the stream's encoder final norm, so that the first part is then the stream's encoder output, which every
decoder block reads as its cross-attention's keys and values while it runs on the second part. Each
stream carries (:class:`~featcal.calibration.adapters.CarryingAdapter`) its encoder's final-norm scale,
from its stem, and the position biases its first block of each stack computes from that block's own
relative-attention table: the expert's stream reads the expert's, the merged model's stream the merged
model's (the tables are not calibrated). Masks are made by transformers' own functions, as
``T5Stack.forward`` makes them, so the chain of blocks is the model's own forward.

Per block every T5LayerNorm (RMS, no bias: a scale-only closed form) and every linear is solved:
self-attention q/k/v (one group: one input), o; in a decoder block the cross-attention's q (reading the
decoder stream) and its k/v (one group reading the encoder output, with the teacher input
α·encoder_expert + (1 − α)·encoder_student as for every other input), o; the feed-forward's wi (or wi_0/wi_1,
one group) and wo. The embedding, the final norms, the relative-attention tables and the LM head keep their
merged values. Padding weighs 0, and so do the decoder positions beyond each target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, Carry, Normalization, TokenWeighting
from featcal.errors import FeatcalError

INPUT_IDS = "input_ids"  # the stem's inputs: the encoder's tokens ...
DECODER_INPUT_IDS = "decoder_input_ids"  # ... and the decoder's (the target shifted right)
ATTENTION_MASK = "attention_mask"  # the context: 1 for an input token, 0 for padding ...
DECODER_ATTENTION_MASK = "decoder_attention_mask"  # ... and 1 for a decoder position of the target
ENCODER_NORM = "encoder_final_norm"  # what a stream carries: its encoder final norm's scale ...
ENCODER_BIAS = "encoder_position_bias"  # ... and the position biases of its encoder's and decoder's first blocks
DECODER_BIAS = "decoder_position_bias"
# Token weighting keys: what a submodule reads, of a stream's [encoder | decoder] positions.
ENCODER, DECODER = "encoder", "decoder"
CROSS_KEYS = ("EncDecAttention.k", "EncDecAttention.v")  # a decoder block's submodules reading the encoder output


class _Stem(nn.Module):
    """The shared token embedding and the encoder's final norm: what a stream takes from its model outside the
    blocks (the norm is applied by the last encoder block, with the scale the stream carries)."""

    def __init__(self, shared: nn.Module, final_layer_norm: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.final_layer_norm = final_layer_norm

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.shared(input_ids), self.shared(decoder_input_ids)], dim=1)


@dataclass(frozen=True)
class Seq2SeqContext:
    """What every block of one forward batch reads besides the stream: where its encoder positions end, the
    encoder's depth, and the encoder, decoder and cross-attention masks (transformers' own)."""

    encoder_length: int
    encoder_layers: int
    encoder_mask: Any
    decoder_mask: Any
    cross_mask: Any


def rms_normalize(eps: float):
    """A T5LayerNorm's normalisation without its scale, in float32 as transformers computes its variance."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    return normalize


def apply_final_norm(hidden: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``T5LayerNorm.forward`` with the scale ``scale``: the encoder's final norm of one stream."""
    variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if scale.dtype in (torch.float16, torch.bfloat16):
        hidden = hidden.to(scale.dtype)
    return scale * hidden


class T5Adapter:
    """A ``T5ForConditionalGeneration`` of transformers 5 (see the module docstring).

    Checkpoint keys are the model's own (``encoder.block.0.layer.0.SelfAttention.q.weight``). A layer's
    prefix depends on the encoder's depth, which the adapter reads from the model :meth:`layers` is given:
    every user of an adapter asks for the layers before it asks for a prefix.
    """

    def __init__(self) -> None:
        self.encoder_layers: int | None = None

    def _encoder_depth(self) -> int:
        if self.encoder_layers is None:
            raise FeatcalError("The T5 adapter was asked for a layer's prefix before it was shown the model's layers.")
        return self.encoder_layers

    def tower(self, model: nn.Module) -> nn.Module:
        return model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        self.encoder_layers = len(model.encoder.block)
        return nn.ModuleList([*model.encoder.block, *model.decoder.block])

    def stem(self, model: nn.Module) -> nn.Module:
        return _Stem(model.shared, model.encoder.final_layer_norm)

    def stem_parts(self) -> dict[str, str]:
        return {"shared": "shared.", "final_layer_norm": "encoder.final_layer_norm."}

    def layer_prefix(self, index: int) -> str:
        depth = self._encoder_depth()
        return f"encoder.block.{index}." if index < depth else f"decoder.block.{index - depth}."

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        return stem(batch.inputs[INPUT_IDS], batch.inputs[DECODER_INPUT_IDS])

    def stem_carry(self, stem: nn.Module) -> Carry:
        return {ENCODER_NORM: stem.final_layer_norm.weight}

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> Seq2SeqContext:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        mask = batch.context[ATTENTION_MASK]
        length = mask.shape[1]
        encoder, decoder = hidden[:, :length], hidden[:, length:]
        encoder_config, decoder_config = model.encoder.config, model.decoder.config
        return Seq2SeqContext(
            encoder_length=length,
            encoder_layers=len(model.encoder.block),
            encoder_mask=create_bidirectional_mask(config=encoder_config, inputs_embeds=encoder, attention_mask=mask),
            decoder_mask=create_causal_mask(
                config=decoder_config,
                inputs_embeds=decoder,
                attention_mask=batch.context.get(DECODER_ATTENTION_MASK),
                cache=None,
            ),
            cross_mask=create_bidirectional_mask(
                config=decoder_config, inputs_embeds=decoder, attention_mask=mask, encoder_hidden_states=encoder
            ),
        )

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: Seq2SeqContext) -> torch.Tensor:
        raise FeatcalError("A T5 block runs with its stream's carry: call run_layer_carried.")

    def run_layer_carried(
        self, layer: nn.Module, hidden: torch.Tensor, context: Seq2SeqContext, carry: Carry
    ) -> tuple[torch.Tensor, Carry]:
        length = context.encoder_length
        encoder, decoder = hidden[:, :length], hidden[:, length:]
        attention = layer.layer[0].SelfAttention
        first = attention.has_relative_attention_bias  # computes its stack's position bias from its own table
        if layer.is_decoder:
            key = DECODER_BIAS
            out, bias, _ = layer(
                decoder,
                attention_mask=context.decoder_mask,
                position_bias=None if first else carry[key],
                encoder_hidden_states=encoder,
                encoder_attention_mask=context.cross_mask,
            )
            out = torch.cat([encoder, out], dim=1)
        else:
            key = ENCODER_BIAS
            out, bias, _ = layer(
                encoder, attention_mask=context.encoder_mask, position_bias=None if first else carry[key]
            )
            if attention.layer_idx == context.encoder_layers - 1:  # the encoder's output: its final norm
                out = apply_final_norm(out, carry[ENCODER_NORM], layer.layer[0].layer_norm.variance_epsilon)
            out = torch.cat([out, decoder], dim=1)
        return out, ({**carry, key: bias} if first else carry)

    def head(self, model: nn.Module) -> nn.Module:
        return model.decoder.final_layer_norm

    def head_prefix(self) -> str:
        return "decoder.final_layer_norm."

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch) -> torch.Tensor:
        """The decoder's final norm at its first position: what the first target token is predicted from."""
        return head(hidden[:, batch.context[ATTENTION_MASK].shape[1]])

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        return {
            name: module
            for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) or type(module).__name__ == "T5LayerNorm"
        }

    def normalization(self, module: nn.Module) -> Normalization | None:
        if isinstance(module, nn.Linear):
            return None
        if type(module).__name__ != "T5LayerNorm":
            raise TypeError(f"{type(module).__name__} is neither an nn.Linear nor a T5LayerNorm")
        return Normalization(rms_normalize(float(module.variance_epsilon)), has_bias=False)

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        """An encoder block's submodules, and a decoder block's cross-attention keys and values, read the
        stream's first (encoder) positions; a decoder block's others its last (decoder) positions. Every
        token weighs 1 but padding and the decoder positions beyond the target (the batch's token weights)."""
        if layer_index < self._encoder_depth() or module_name.endswith(CROSS_KEYS):
            return TokenWeighting(ENCODER, None, "first")
        return TokenWeighting(DECODER, None, "last")
