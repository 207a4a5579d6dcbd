"""The calibration's view of the test MLP: a stream of one position, its blocks' ``fc`` solved."""

from __future__ import annotations

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, Normalization, TokenWeighting

VECTORS = "x"  # the stem's one input


class MLPAdapter:
    """Every block's ``nn.Linear``; no context, every example weighing 1."""

    def tower(self, model: nn.Module) -> nn.Module:
        return model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.layers

    def stem(self, model: nn.Module) -> nn.Module:
        return model.stem

    def stem_parts(self) -> dict[str, str]:
        return {"": "stem."}

    def layer_prefix(self, index: int) -> str:
        return f"layers.{index}."

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        return stem(batch.inputs[VECTORS]).unsqueeze(1)

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> None:
        return None

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: None = None) -> torch.Tensor:
        return layer(hidden)

    def head(self, model: nn.Module) -> nn.Module:
        return model.head

    def head_prefix(self) -> str:
        return "head."

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch | None = None) -> torch.Tensor:
        return hidden[:, 0]

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        return {"fc": layer.fc}

    def normalization(self, module: nn.Module) -> Normalization | None:
        return None

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        return TokenWeighting("ones", None)
