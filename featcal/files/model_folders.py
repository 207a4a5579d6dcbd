"""Model folders written from state dicts without a second copy of the weights: whole, or tensor by tensor.

The model that writes a folder is built on the meta device (no memory, no random initialisation) by
the caller, which knows the model's class and configuration; this module writes what it is given.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.files.atomic import atomic_folder

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.files.safetensors_writer import SafetensorsWriter

MODEL_CONFIG = "config.json"  # a model folder's transformers configuration
WEIGHTS = "model.safetensors"  # a model folder's weights, in one file
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded model folder's index of its weight files


def save_model_state(
    model: nn.Module, state: Mapping[str, torch.Tensor], folder: str | Path, *, companions: Sequence[Path] = ()
) -> Path:
    """Save ``state`` as the folder of ``model`` (on the meta device: its class, configuration and the
    keys, shapes and dtypes of its state dict), atomically.

    Tensors are written in the model's parameter dtype, as loading them into a materialised model would.
    ``companions`` (a tokenizer's files, say) are copied in beside them, under their own names.

    Raises:
        ValueError: when ``state`` lacks a tensor of the model, has one it does not know, or one of
            another shape.
    """
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"Not the state of this {type(model).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shapes {wrong[:3]}."
        )
    tensors = {k: v.detach().to(device="cpu", dtype=expected[k].dtype) for k, v in state.items()}
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp, state_dict=tensors)
        _copy_companions(companions, tmp)
    return Path(folder)


def _copy_companions(companions: Sequence[Path], folder: Path) -> None:
    for path in companions:
        shutil.copyfile(path, folder / path.name)


@contextmanager
def streamed_model_folder(
    model: nn.Module, folder: str | Path, *, companions: Sequence[Path] = ()
) -> Iterator[SafetensorsWriter]:
    """The folder of ``model`` (on the meta device), its weights written tensor by tensor, atomically.

    Args:
        model: The model whose configuration is written as ``config.json`` and whose state dict's keys,
            shapes and dtypes the weights file is laid out for.
        folder: The folder to write (replaced when it exists, once the block ends).
        companions: Files copied in beside the weights, under their own names (a tokenizer's files).

    Yields a :class:`~featcal.files.safetensors_writer.SafetensorsWriter`; every tensor must be written
    before the block ends. The folder appears, with the ``config.json`` ``save_pretrained`` writes, only
    then: a block that raises leaves nothing behind.

    Raises:
        ValueError: when the block ends with a tensor not written.
    """
    layout = {key: (value.dtype, tuple(value.shape)) for key, value in model.state_dict().items()}
    with atomic_folder(folder) as tmp:
        model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # as save_pretrained sets
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        from featcal.files.safetensors_writer import SafetensorsWriter  # torch: imported when a folder is written

        writer = SafetensorsWriter(tmp / WEIGHTS, layout, {"format": "pt"})
        try:
            yield writer
            writer.close()
        finally:
            writer.discard()
        _copy_companions(companions, tmp)
