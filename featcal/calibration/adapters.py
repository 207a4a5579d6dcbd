"""What the calibration needs to know about a model's architecture, and the batches it feeds it.

The driver (:mod:`featcal.calibration.driver`), the sweep and the feature-drift meter know no model:
a model family gives them a :class:`LayerAdapter` (how to reach layer 0's input, run one layer with
its per-batch context, which submodules to solve in firing order and how norms normalise, how tokens
weigh) and :class:`CalibrationBatch` objects (the examples' tensors and the context every layer reads).

Two extensions serve a model whose layers are not one uniform stack (an encoder-decoder):

- a :class:`CarryingAdapter`'s streams each carry tensors from their stem and layers to their later
  layers (a :data:`Carry`: T5's position biases, which its first block of each stack computes from its
  own relative-attention table, and its encoder's final-norm scale), kept per stream, so that the
  expert's stream reads the expert's and the merged model's stream the merged model's;
- a submodule may read only some of a stream's positions (:attr:`TokenWeighting.positions`: an
  encoder-decoder's stream holds the encoder's positions, then the decoder's).

Adapters without them (CLIP, the causal LMs) are run exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class TokenWeighting:
    """Per-position weights for one submodule: ``key`` identifies the profile, ``weights`` has one entry
    per sequence position (``None`` means every position weighs 1). They multiply the batch's own token
    weights (:attr:`CalibrationBatch.token_weights`). ``positions`` (:data:`POSITIONS`) says which of the
    stream's positions the submodule reads; per-position weights need ``all``.

    Raises:
        ValueError: for an unknown ``positions``, or per-position weights of a submodule that reads some.
    """

    key: str
    weights: torch.Tensor | None
    positions: str = "all"

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, not {self.positions!r}")
        if self.positions != "all" and self.weights is not None:
            raise ValueError("per-position weights apply to a submodule that reads every position of its stream")


POSITIONS = ("all", "first", "last")
"""Which of a stream's positions a submodule's input lines up with: all of them, or the first (last) as many
as the input has: a T5 stream is ``[encoder positions | decoder positions]``, its encoder's submodules and
its cross-attention keys and values read the first, its decoder's others the last. The batch's token
weights of those positions weigh the input's tokens."""


@dataclass(frozen=True)
class Normalization:
    """How a normalisation submodule maps its input ``x`` to ``z`` before its affine, and that affine.

    Attributes:
        normalize: ``z`` from ``x`` ([..., d] to [..., d], float32 at least): LayerNorm without affine,
            or ``x / rms(x)`` for an RMSNorm.
        has_bias: The affine is ``γ·z + β`` (LayerNorm); else ``γ·z`` (RMSNorm).
        scale_offset: The module's weight ``w`` scales by ``scale_offset + w`` (Gemma's RMSNorm: 1).
    """

    normalize: Callable[[torch.Tensor], torch.Tensor]
    has_bias: bool = True
    scale_offset: float = 0.0


@dataclass
class CalibrationBatch:
    """Examples for the calibration, one row each: what the stem reads, and what every layer reads.

    Attributes:
        inputs: The stem's tensors by name (``pixel_values``; ``input_ids``), rows = examples. The
            driver drops them once the first layer's input is computed.
        context: Tensors every layer reads (``attention_mask``), rows = examples; kept through the layers.
        token_weights: ``[rows, seq]``: each token's weight in the statistics (0 for padding), or None
            when every token weighs 1.
    """

    inputs: Mapping[str, torch.Tensor]
    context: Mapping[str, torch.Tensor] = field(default_factory=dict)
    token_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        first = next(iter(self.inputs.values()), None)
        if first is None:
            first = next(iter(self.context.values()), None)
        if first is None:
            raise ValueError("a calibration batch holds no tensor")
        return first.shape[0]

    def rows(self, start: int, stop: int) -> CalibrationBatch:
        """Examples ``start`` to ``stop`` (views, no copies)."""
        return CalibrationBatch(
            {k: v[start:stop] for k, v in self.inputs.items()},
            {k: v[start:stop] for k, v in self.context.items()},
            None if self.token_weights is None else self.token_weights[start:stop],
        )

    def for_layers(self, device: torch.device | str) -> CalibrationBatch:
        """The context and token weights on ``device``, without the stem's inputs."""
        return CalibrationBatch(
            {},
            {k: v.to(device) for k, v in self.context.items()},
            None if self.token_weights is None else self.token_weights.to(device),
        )


def as_batch(value: CalibrationBatch | torch.Tensor, name: str = "pixel_values") -> CalibrationBatch:
    """``value`` as a batch: a plain tensor is the stem's one input ``name``, every token weighing 1."""
    return value if isinstance(value, CalibrationBatch) else CalibrationBatch({name: value})


class LayerAdapter(Protocol):
    """What the calibration driver, the sweep and the drift meter need to know about a model family.

    A layer is run with the context of its batch: :meth:`layer_context` is called once per forward
    batch with the model, the batch and its hidden states, and its result passed to :meth:`run_layer` for the student's
    and the expert's layer alike (masks, positions, rotary embeddings, an encoder's output). An expert's
    layer is a copy of the model's layer at the same index holding the expert's tensors, so
    :meth:`run_layer` may read what a layer is from the layer itself (a sliding-window layer's attention type).
    """

    def tower(self, model: nn.Module) -> nn.Module:
        """The module whose state dict the checkpoints' keys (as the family reads them) name."""

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The calibrated layers, in forward order."""

    def stem(self, model: nn.Module) -> nn.Module:
        """What makes layer 0's input from the examples (its parameters are read from checkpoints)."""

    def stem_parts(self) -> Mapping[str, str]:
        """The stem's submodules (their paths in :meth:`stem`'s module) and the key prefix of each in a
        checkpoint: how an expert's stem is read."""

    def layer_prefix(self, index: int) -> str:
        """The key prefix of layer ``index`` (``encoder.layers.3.``)."""

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        """Layer 0's input ``[rows, seq, d]`` for a batch of examples."""

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> Any:
        """What every layer reads besides the hidden states ``hidden`` ``[rows, seq, d]`` of one forward
        batch (None when nothing): masks, positions, rotary embeddings."""

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: Any) -> torch.Tensor:
        """One layer's output for ``hidden`` with the batch's ``context``."""

    def head(self, model: nn.Module) -> nn.Module:
        """The module after the last layer whose output the diagnostics compare (CLIP's post-LayerNorm)."""

    def head_prefix(self) -> str:
        """The key prefix of :meth:`head`."""

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch) -> torch.Tensor:
        """The pooled output ``[rows, d]`` the diagnostics compare, from the last layer's output."""

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        """The layer's solved submodules by name: each an ``nn.Linear`` or a normalisation."""

    def normalization(self, module: nn.Module) -> Normalization | None:
        """How a calibrated submodule normalises, when it is a normalisation; None for an ``nn.Linear``."""

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        """The per-position weights of a submodule's statistics in a layer."""


Carry = dict[str, torch.Tensor]
"""Tensors a stream hands from its stem and its layers to its later layers, by name, the same for every
example of the stream (an encoder-decoder's position biases ``[1, heads, q, k]``, a norm's scale)."""


class CarryingAdapter(LayerAdapter, Protocol):
    """A :class:`LayerAdapter` whose streams carry tensors from layer to layer (a :data:`Carry`).

    Each stream (the merged model's, and each expert's) starts with :meth:`stem_carry` of its own stem
    (an expert's stem holds the expert's tensors), and each layer run by :meth:`run_layer_carried` returns
    its output with the carry its stream's later layers read. Where a layer's output replaces a stream,
    the carry returned with it replaces the stream's carry; where the output is dropped (the merged
    layer's statistics pass), so is the carry.
    """

    def stem_carry(self, stem: nn.Module) -> Carry:
        """What a stream with this stem carries into its first layer."""

    def run_layer_carried(
        self, layer: nn.Module, hidden: torch.Tensor, context: Any, carry: Carry
    ) -> tuple[torch.Tensor, Carry]:
        """One layer's output for ``hidden`` with the batch's ``context`` and its stream's ``carry``, and the
        carry of the stream after it."""


def stem_carry(adapter: LayerAdapter, stem: nn.Module) -> Carry | None:
    """What a stream with ``stem`` carries (:class:`CarryingAdapter`), or None for an adapter whose streams
    carry nothing."""
    method = getattr(adapter, "stem_carry", None)
    return None if method is None else dict(method(stem))


def run_layer(
    adapter: LayerAdapter, layer: nn.Module, hidden: torch.Tensor, context: Any, carry: Carry | None
) -> tuple[torch.Tensor, Carry | None]:
    """One layer's output, and its stream's carry after it (None, as given, for a stream that carries nothing:
    the adapter's plain :meth:`LayerAdapter.run_layer`)."""
    if carry is None:
        return adapter.run_layer(layer, hidden, context), None
    return adapter.run_layer_carried(layer, hidden, context, carry)
