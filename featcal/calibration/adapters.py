"""Architecture knowledge for FeatCal, one adapter per model family; the driver knows none of it.

An adapter says how to get the first layer's input, how to run one layer, which submodules of a
layer are calibrated (in forward order), how tokens are weighted, how a layer's parameters are
named in a checkpoint, and (for the feature-drift diagnostics) how the pooled output the zero-shot
heads read is made from the last layer's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class TokenWeighting:
    """Per-token weights for one submodule: ``key`` identifies the profile, ``weights`` has one entry
    per sequence position (``None`` means every token weighs 1)."""

    key: str
    weights: torch.Tensor | None


class ArchitectureAdapter(Protocol):
    """What the calibration driver needs to know about a model family."""

    def tower(self, model: nn.Module) -> nn.Module: ...

    def layers(self, model: nn.Module) -> nn.ModuleList: ...

    def stem(self, model: nn.Module) -> nn.Module: ...

    def stem_prefixes(self) -> tuple[str, ...]: ...

    def layer_prefix(self, index: int) -> str: ...

    def run_stem(self, stem: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor: ...

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def head(self, model: nn.Module) -> nn.Module: ...

    def head_prefix(self) -> str: ...

    def run_head(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]: ...

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting: ...


class _CLIPStem(nn.Module):
    """Patch/position embeddings followed by ``pre_layrnorm``: the input of encoder layer 0."""

    def __init__(self, embeddings: nn.Module, pre_layrnorm: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.pre_layrnorm = pre_layrnorm

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))


class CLIPVisionAdapter:
    """`transformers.CLIPVisionModel` (transformers 4.x and 5.x layouts).

    Token weights follow the FeatCal reference: in the last layer every patch token (all positions
    but the CLS token) weighs ``patch_weight`` for every submodule except ``k_proj`` and ``v_proj``.
    """

    def __init__(self, patch_weight: float = 0.01) -> None:
        self.patch_weight = patch_weight

    @staticmethod
    def tower(model: nn.Module) -> nn.Module:
        """The vision transformer itself: ``model.vision_model`` of a `CLIPVisionModel`, or ``model``."""
        return getattr(model, "vision_model", model)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.tower(model).encoder.layers

    def stem(self, model: nn.Module) -> nn.Module:
        tower = self.tower(model)
        return _CLIPStem(tower.embeddings, tower.pre_layrnorm)

    def stem_prefixes(self) -> tuple[str, ...]:
        return ("embeddings.", "pre_layrnorm.")

    def layer_prefix(self, index: int) -> str:
        return f"encoder.layers.{index}."

    def run_stem(self, stem: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        return stem(pixel_values)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        # transformers 5 returns a Tensor, 4.x a tuple; never index a Tensor output with [0].
        out = layer(hidden, None)
        return out[0] if isinstance(out, tuple) else out

    def head(self, model: nn.Module) -> nn.Module:
        return self.tower(model).post_layernorm

    def head_prefix(self) -> str:
        return "post_layernorm."

    def run_head(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The pooled output (``pooler_output``): ``post_layernorm`` of the CLS token of the last layer."""
        return head(hidden[:, 0])

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        return {
            name: module
            for name, module in layer.named_modules()
            if name and isinstance(module, (nn.Linear, nn.LayerNorm))
        }

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        last = layer_index == num_layers - 1
        if not last or seq_len <= 1 or module_name.endswith(("k_proj", "v_proj")):
            return TokenWeighting("ones", None)
        weights = torch.full((seq_len,), self.patch_weight)
        weights[0] = 1.0
        return TokenWeighting(f"cls-{self.patch_weight}", weights)
