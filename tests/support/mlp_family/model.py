"""The test family's model: a transformers ``PreTrainedModel`` of its own, registered with the Auto classes at test
time (so ``AutoModel`` loads a release of it, with no remote code), and its folders."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from featcal.checkpoint import Checkpoint, load_params
from featcal.errors import ModelInputError
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.model_folders import save_model_state, streamed_model_folder
from tests.support.mlp_family import MODEL_TYPE

SHAPE_KEYS = ("in_features", "hidden_size", "num_layers", "classes")


class MLPConfig(PretrainedConfig):
    """Vectors of ``in_features`` to a stream of ``hidden_size``, ``num_layers`` blocks, ``classes`` logits."""

    model_type = MODEL_TYPE

    def __init__(self, in_features: int = 6, hidden_size: int = 8, num_layers: int = 2, classes: int = 3, **kw) -> None:
        self.in_features, self.hidden_size, self.num_layers, self.classes = (
            in_features,
            hidden_size,
            num_layers,
            classes,
        )
        super().__init__(**kw)


class Block(nn.Module):
    """One calibrated layer: ``x + tanh(fc(x))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class MLPModel(PreTrainedModel):
    """Stem, blocks and class head."""

    config_class = MLPConfig
    base_model_prefix = "mlp"

    def __init__(self, config: MLPConfig) -> None:
        super().__init__(config)
        self.stem = nn.Linear(config.in_features, config.hidden_size)
        self.layers = nn.ModuleList(Block(config.hidden_size) for _ in range(config.num_layers))
        self.head = nn.Linear(config.hidden_size, config.classes)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Weights are set by the test's own seeds; nothing to initialise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(x)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def register_auto_classes() -> None:
    """Make ``AutoConfig`` and ``AutoModel`` know the test model (once per process)."""
    try:
        AutoConfig.register(MODEL_TYPE, MLPConfig)
        AutoModel.register(MLPConfig, MLPModel)
    except ValueError:  # already registered by an earlier test
        pass


def _meta(config: MLPConfig) -> MLPModel:
    with torch.device("meta"):
        return MLPModel(config)


def check_base_folder(folder: Path) -> None:
    """Refuse a folder of another model type."""
    if json.loads((folder / MODEL_CONFIG).read_text())["model_type"] != MODEL_TYPE:
        raise ModelInputError(str(folder), f"{folder} is not a {MODEL_TYPE} model.")


def checkpoint(folder: Path, name: str | None = None) -> Checkpoint:
    return Checkpoint(folder, name=name)


def model_config(base_folder: Path) -> MLPConfig:
    return MLPConfig.from_pretrained(str(base_folder))


def check_like_base(folder: Path, base_folder: Path, what: str) -> None:
    """Refuse a model whose shape differs from the base's."""
    mine, base = model_config(folder), model_config(base_folder)
    for key in SHAPE_KEYS:
        if getattr(mine, key) != getattr(base, key):
            raise ModelInputError(str(folder), f"{what} {folder} has {key} {getattr(mine, key)}, the base's differs.")


def check_model_folder(folder: Path, base: Checkpoint | None = None) -> Checkpoint:
    check_base_folder(folder)
    return checkpoint(folder)


def load_model(folder: Path, base: Checkpoint | None = None) -> MLPModel:
    check_model_folder(folder, base)
    return MLPModel.from_pretrained(str(folder), dtype=torch.float32).eval()


def build_model(config: MLPConfig, state: Mapping[str, torch.Tensor]) -> MLPModel:
    model = MLPModel(config)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def save_model(
    state: Mapping[str, torch.Tensor], config: MLPConfig, folder: Path, *, output_dtype: str = "base"
) -> Path:
    return save_model_state(_meta(config), state, folder)


def streamed_model(config: MLPConfig, folder: Path, *, output_dtype: str = "base") -> Any:
    return streamed_model_folder(_meta(config), folder)


def skeleton(folder: Path, merged: Checkpoint, device: torch.device) -> MLPModel:
    """The model with its stem and head on ``device`` (read from ``merged``) and its blocks on the meta device."""
    config = model_config(folder)
    shallow = copy.deepcopy(config)
    shallow.num_layers = 0
    model = MLPModel(shallow).to(device)
    load_params(model, merged, "")
    model.config = config
    model.layers.extend(_meta(config).layers)
    return model.eval()
