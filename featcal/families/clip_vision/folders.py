"""CLIP model folders: the base ``CLIPModel`` checked, vision towers (``CLIPVisionModel``) checked, loaded,
built from state dicts and written, whole or tensor by tensor.

The part of a CLIP that featcal merges and calibrates is the vision tower: a ``CLIPModel`` folder's
``vision_model.*`` tensors, or a ``CLIPVisionModel`` folder's.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from featcal.calibration.adapters import LayerAdapter
from featcal.checkpoint import Checkpoint, check_same_architecture, load_params
from featcal.errors import ModelInputError
from featcal.families.likeness import check_like_base
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.model_folders import save_model_state, streamed_model_folder
from featcal.files.safetensors_writer import ShardedSafetensorsWriter

if TYPE_CHECKING:
    from transformers import CLIPVisionConfig

logger = logging.getLogger(__name__)

# The configuration keys an expert or a merged tower must share with the base (docs/reliability.md lists them).
LIKE_BASE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size",
    "hidden_act",
)  # fmt: skip
VISION_PREFIX = "vision_model."  # a CLIPModel's vision tower in its checkpoint
MODEL_TYPES = ("clip_vision_model", "clip")  # what a vision tower's config.json may say


def vision_checkpoint(path: str | Path, name: str | None = None) -> Checkpoint:
    """The vision-tower tensors of a ``CLIPModel`` or ``CLIPVisionModel`` folder (or safetensors file),
    keyed without the ``vision_model.`` prefix, read lazily.

    Raises:
        ModelInputError: for a folder without safetensors weights, or a file that does not read.
    """
    return Checkpoint(path, name=name, prefix=VISION_PREFIX, part="vision tower")


def check_clip_model_folder(folder: str | Path) -> None:
    """Refuse a base model folder whose config is not a CLIPModel's (e.g. a lone CLIPVisionModel).

    Raises:
        ModelInputError: naming the folder, its model type and the fix.
    """
    config = Path(folder) / MODEL_CONFIG
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ModelInputError(str(folder), f"The base model {folder} has no readable config.json.") from None
    if model_type != "clip":
        raise ModelInputError(
            str(folder),
            f"The base model {folder} is a {model_type!r} model, not a CLIPModel with a text tower (model_type "
            "'clip'): give the full CLIP the experts were fine-tuned from, e.g. openai/clip-vit-base-patch32.",
        )


def build_vision_model(vision_config: CLIPVisionConfig, state: Mapping[str, torch.Tensor]):
    """A `CLIPVisionModel` of the base's configuration holding ``state``."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel(vision_config)
    model.load_state_dict(dict(state), strict=True)
    return model.eval()


def load_vision_folder(path: str | Path, base: Checkpoint | None = None):
    """A `CLIPVisionModel` from a folder (safetensors only), in float32, its tensors checked.

    Args:
        path: A `CLIPVisionModel` (or `CLIPModel`) folder.
        base: When given, the model must have the base's vision architecture.

    Raises:
        ModelInputError: for a folder without config or safetensors weights, a tensor that is not
            finite (naming file and tensor), or an architecture other than the base's.
    """
    from transformers import CLIPVisionConfig, CLIPVisionModel

    checkpoint = check_vision_folder(path, base)
    try:
        if _model_type(Path(path)) == "clip":  # a whole CLIPModel: its vision tower alone, without the load
            logger.info("%s is a CLIPModel: its vision tower is used, its text tower ignored", path)  # report
            with checkpoint.reading():
                state = {key: checkpoint[key].to(torch.float32) for key in checkpoint}
            return build_vision_model(CLIPVisionConfig.from_pretrained(str(path)), state)
        return CLIPVisionModel.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(
            str(path), f"{path} does not load as a CLIPVisionModel ({first}): its config.json and weights disagree."
        ) from None


def _model_type(folder: Path) -> str | None:
    """The ``model_type`` of a model folder's ``config.json``."""
    return json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("model_type")


def vision_config(folder: Path):
    """The vision tower's configuration of a `CLIPVisionModel` or `CLIPModel` folder.

    Raises:
        ModelInputError: for a configuration transformers cannot read.
    """
    from transformers import CLIPVisionConfig

    try:
        return CLIPVisionConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(str(folder), f"{folder / MODEL_CONFIG} does not read ({first}).") from None


def check_vision_like_base(folder: Path, base_folder: Path, what: str) -> None:
    """Refuse a vision tower whose configuration (:data:`LIKE_BASE_KEYS`) differs
    from the base's.

    Raises:
        ModelInputError: naming the model, what differs and both values.
    """
    check_like_base(folder, base_folder, what, keys=LIKE_BASE_KEYS, read_config=vision_config, tokenizer=False)


def check_vision_folder(path: str | Path, base: Checkpoint | None = None) -> Checkpoint:
    """Check a `CLIPVisionModel` folder as :func:`load_vision_folder` does, without loading the model.

    Args:
        path: A `CLIPVisionModel` (or `CLIPModel`) folder.
        base: When given, the model must have the base's vision architecture.

    Returns:
        The folder's tensors, read lazily.

    Raises:
        ModelInputError: for a folder without config or safetensors weights, a tensor that is not
            finite (naming file and tensor), or an architecture other than the base's.
    """
    folder = Path(path)
    if not (folder / MODEL_CONFIG).is_file():
        raise ModelInputError(
            str(folder),
            f"{folder} is not a model folder (no config.json); "
            "pass a folder written by `featcal merge` or `save_pretrained`.",
        )
    try:
        model_type = _model_type(folder)
    except (OSError, ValueError, AttributeError):
        raise ModelInputError(
            str(folder), f"{folder / 'config.json'} is not readable JSON: save the model again with `save_pretrained`."
        ) from None
    if model_type not in MODEL_TYPES:
        raise ModelInputError(
            str(folder),
            f"{folder} holds a {model_type!r} model, not a CLIP vision tower (model_type 'clip_vision_model' or "
            "'clip'): pass a folder written by `featcal merge` or a CLIP model's `save_pretrained`.",
        )
    checkpoint = vision_checkpoint(folder)  # raises a clear error for missing or pickle-only weights
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
        check_vision_like_base(folder, base.path, "model")
    return checkpoint


def save_vision_model(state: Mapping[str, torch.Tensor], vision_config, folder: str | Path) -> Path:
    """Save a vision-tower state dict as a `transformers.CLIPVisionModel` folder, atomically.

    The model that writes the folder is built on the meta device and saves ``state`` itself: no second
    copy of the weights in memory and no random initialisation. Tensors are written in the model's
    parameter dtype, as loading them into a materialised model would.

    Raises:
        ValueError: when ``state`` lacks a tensor of the model, has one it does not know, or one of
            another shape.
    """
    return save_model_state(meta_vision_model(vision_config), state, folder)


@contextmanager
def streamed_vision_model(vision_config: CLIPVisionConfig, folder: str | Path) -> Iterator[ShardedSafetensorsWriter]:
    """A `transformers.CLIPVisionModel` folder written tensor by tensor, atomically.

    Args:
        vision_config: The model's configuration, written as ``config.json``.
        folder: The folder to write (replaced when it exists, once the block ends).

    Yields a :class:`~featcal.files.safetensors_writer.ShardedSafetensorsWriter` laid out for the model's state
    dict (its parameter dtype, keys as :func:`save_vision_model` writes them); every tensor must be
    written before the block ends. The folder appears, with the same ``config.json``, only then: a
    block that raises leaves nothing behind.

    Raises:
        ValueError: when the block ends with a tensor not written.
    """
    with streamed_model_folder(meta_vision_model(vision_config), folder) as writer:
        yield writer


def meta_vision_model(vision_config: CLIPVisionConfig):
    """A `CLIPVisionModel` on the meta device: its state dict's keys, shapes and dtypes, no memory."""
    from transformers import CLIPVisionModel

    with torch.device("meta"):
        return CLIPVisionModel(vision_config)


def vision_skeleton(
    vision_config: CLIPVisionConfig, merged: Checkpoint, device: torch.device, adapter: LayerAdapter
) -> nn.Module:
    """A `CLIPVisionModel` with the merged stem and final LayerNorm on ``device`` and its encoder
    layers on the meta device (no memory, no random initialisation of the layers).

    Args:
        vision_config: The model's configuration.
        merged: The merged model's tensors, for the stem and the final LayerNorm.
        device: Where those live.
        adapter: The architecture adapter (where the layers are).

    Returns:
        The model, in eval mode.

    Raises:
        FeatcalError: when ``merged`` lacks a tensor of the stem or the final LayerNorm.
    """
    from transformers import CLIPVisionModel

    with torch.device("meta"):
        layers = adapter.layers(CLIPVisionModel(vision_config))
    shallow = copy.deepcopy(vision_config)
    shallow.num_hidden_layers = 0
    model = CLIPVisionModel(shallow).to(device)
    load_params(adapter.tower(model), merged, "")  # every tensor but the layers'
    adapter.layers(model).extend(layers)
    return model.eval()
