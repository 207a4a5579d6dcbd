"""The calibration's view of a `transformers.CLIPVisionModel` (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, Normalization, TokenWeighting

PIXELS = "pixel_values"  # the stem's one input


class _CLIPStem(nn.Module):
    """Patch/position embeddings followed by ``pre_layrnorm``: the input of encoder layer 0."""

    def __init__(self, embeddings: nn.Module, pre_layrnorm: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.pre_layrnorm = pre_layrnorm

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))


class CLIPVisionAdapter:
    """`transformers.CLIPVisionModel`: every ``nn.Linear`` and ``nn.LayerNorm`` of the encoder layers.

    Token weights follow the FeatCal reference: in the last layer every patch token (all positions
    but the CLS token) weighs ``patch_weight`` for every submodule except ``k_proj`` and ``v_proj``.
    Images have no padding and the layers no context: :meth:`layer_context` is None.
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

    def stem_parts(self) -> dict[str, str]:
        return {"embeddings": "embeddings.", "pre_layrnorm": "pre_layrnorm."}

    def layer_prefix(self, index: int) -> str:
        return f"encoder.layers.{index}."

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        return stem(batch.inputs[PIXELS])

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> None:
        return None

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: None = None) -> torch.Tensor:
        # transformers 5 returns a Tensor, 4.x a tuple; never index a Tensor output with [0].
        out = layer(hidden, None)
        return out[0] if isinstance(out, tuple) else out

    def head(self, model: nn.Module) -> nn.Module:
        return self.tower(model).post_layernorm

    def head_prefix(self) -> str:
        return "post_layernorm."

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch | None = None) -> torch.Tensor:
        """The pooled output (``pooler_output``): ``post_layernorm`` of the CLS token of the last layer."""
        return head(hidden[:, 0])

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        return {
            name: module
            for name, module in layer.named_modules()
            if name and isinstance(module, (nn.Linear, nn.LayerNorm))
        }

    def normalization(self, module: nn.Module) -> Normalization | None:
        if not isinstance(module, nn.LayerNorm):
            return None
        shape, eps = module.normalized_shape, module.eps
        return Normalization(lambda x: F.layer_norm(x, shape, eps=eps), has_bias=True)

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        last = layer_index == num_layers - 1
        if not last or seq_len <= 1 or module_name.endswith(("k_proj", "v_proj")):
            return TokenWeighting("ones", None)
        weights = torch.full((seq_len,), self.patch_weight)
        weights[0] = 1.0
        return TokenWeighting(f"cls-{self.patch_weight}", weights)
