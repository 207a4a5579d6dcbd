"""Model folders written from state dicts without a second copy of the weights: whole, or tensor by tensor.

The model that writes a folder is built on the meta device (no memory, no random initialisation) by
the caller, which knows the model's class and configuration; this module writes what it is given.

A folder holds what transformers' ``save_pretrained`` writes for the model: ``config.json`` and the
tensors ``save_pretrained`` keeps, in one ``model.safetensors`` or, given a size limit the weights
exceed, in shards ``model-00001-of-0000N.safetensors`` and their index ``model.safetensors.index.json``,
assigned to the shards by ``huggingface_hub.split_torch_state_dict_into_shards`` as ``save_pretrained``
assigns them. A tensor tied to another (``lm_head.weight`` to ``model.embed_tokens.weight`` in a language
model with ``tie_word_embeddings``) is stored once, under the key ``save_pretrained`` keeps; its other
key is optional and, when given, must hold the same values. Tensors are stored in the model's dtype, or
in a ``dtype`` asked for (floating-point ones only; integer buffers keep theirs).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from featcal.files.atomic import atomic_folder
from featcal.files.model_files import WEIGHTS, WEIGHTS_INDEX
from featcal.files.safetensors_writer import Layout, ShardedSafetensorsWriter

if TYPE_CHECKING:
    from torch import nn

SHARD_PATTERN = WEIGHTS.replace(".safetensors", "{suffix}.safetensors")  # as save_pretrained names shards
ONE_FILE = sys.maxsize  # a shard limit no model reaches: the weights in one file


@dataclass(frozen=True)
class SavedLayout:
    """The tensors ``save_pretrained`` writes for a model.

    Attributes:
        tensors: Each stored tensor's dtype and shape, in the order ``save_pretrained`` shards them.
        aliases: Each key of the state dict not stored because it is a stored tensor under a second
            name (tied weights), and that name.
        ignored: The keys of the state dict ``save_pretrained`` drops (the model's ``_keys_to_ignore_on_save``).
    """

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    aliases: dict[str, str]
    ignored: frozenset[str]


def saved_layout(model: nn.Module, dtype: torch.dtype | None = None) -> SavedLayout:
    """What ``model.save_pretrained`` stores for ``model`` (on the meta device), in its order.

    Runs transformers' own steps on the meta state dict: the keys the model ignores on save are dropped,
    then each tied tensor's aliases (``remove_tied_weights_from_state_dict``: it keeps
    ``model.embed_tokens.weight`` and drops ``lm_head.weight``), and the weight conversions a save reverts
    must leave the keys and shapes as they are.

    Args:
        model: A transformers model.
        dtype: The floating-point dtype its floating-point tensors are stored in (None: their own).

    Returns:
        The stored tensors' layout, the aliases and the ignored keys.

    Raises:
        ValueError: when ``save_pretrained`` would store the weights under other keys or shapes than
            the state dict's (a conversion mapping): a write keyed by the state dict could not follow.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    ignored = frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ()) & set(state)
    kept = remove_tied_weights_from_state_dict({k: v for k, v in state.items() if k not in ignored}, model)
    owner = {id(model.get_parameter_or_buffer(key)): key for key in kept}
    aliases = {
        key: owner[id(model.get_parameter_or_buffer(key))] for key in state if key not in kept and key not in ignored
    }
    reverted = revert_weight_conversion(model, dict(kept))
    if set(reverted) != set(kept) or any(tuple(reverted[k].shape) != tuple(kept[k].shape) for k in kept):
        raise ValueError(
            f"save_pretrained stores the weights of {type(model).__name__} under other keys or shapes than its state "
            "dict's (a weight conversion): featcal writes the state dict's keys as they are."
        )
    tensors = {
        key: (dtype if dtype is not None and value.is_floating_point() else value.dtype, tuple(value.shape))
        for key, value in reverted.items()
    }
    return SavedLayout(tensors, aliases, ignored)


def shard_layout(
    model: nn.Module, layout: Layout, max_shard_bytes: int | None
) -> tuple[dict[str, Layout], dict | None]:
    """The weight files of ``layout`` and their index, as ``save_pretrained(max_shard_size=max_shard_bytes)``
    splits them (``huggingface_hub.split_torch_state_dict_into_shards``, in ``layout``'s order).

    A shard takes tensors in order while its bytes stay within the limit; a tensor larger than the limit
    gets a shard of its own, numbered before the shard still being filled (so shard numbers need not
    follow the keys' order). ``total_size`` counts the tensors' bytes (no headers).

    Args:
        model: The model (its parameter count goes into the index, as ``save_pretrained`` writes it).
        layout: The stored tensors, in ``save_pretrained``'s order.
        max_shard_bytes: The limit of a shard's tensor bytes; None for one file.

    Returns:
        Each file's name and layout, and the index (``metadata`` with ``total_parameters`` and
        ``total_size``, ``weight_map``), or None when the weights fit in one ``model.safetensors``.
    """
    if max_shard_bytes is None or not layout:
        return {WEIGHTS: dict(layout)}, None
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (dtype, shape) in layout.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_bytes)
    files = {file: {key: layout[key] for key in keys} for file, keys in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return files, None
    index = {
        "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
        "weight_map": split.tensor_to_filename,
    }
    return files, index


def _check_options(max_shard_bytes: int | None, dtype: torch.dtype | None) -> None:
    if max_shard_bytes is not None and (
        isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0
    ):
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, not {max_shard_bytes!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype, not {dtype!r}")


def save_model_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    companions: Sequence[Path] = (),
) -> Path:
    """Save ``state`` as the folder of ``model`` (on the meta device: its class, configuration and the
    keys, shapes and dtypes of its state dict), atomically, with ``save_pretrained``.

    Tensors are written in the model's parameter dtype, as loading them into a materialised model would,
    or in ``dtype``. A tied tensor's alias (``lm_head.weight`` with ``tie_word_embeddings``) may be left
    out of ``state``; given, it must equal the tensor it is stored as, after the cast.

    Args:
        model: The model whose folder is written.
        state: Its tensors, keyed as its state dict.
        folder: The folder to write (replaced when it exists).
        max_shard_bytes: Shards of at most this many bytes of tensors (``save_pretrained``'s
            ``max_shard_size``, an int of bytes; one tensor larger is a shard of its own); None for one
            ``model.safetensors`` however large.
        dtype: The floating-point dtype floating-point tensors are stored in, and ``config.json``'s
            ``dtype`` (None: the model's).
        companions: Files copied in beside the weights, under their own names (a tokenizer's files).

    Returns:
        ``folder``.

    Raises:
        ValueError: when ``state`` lacks a tensor of the model, has one it does not know, or one of
            another shape; for an alias that differs from its tensor; for a ``max_shard_bytes`` that is
            not a positive int or a ``dtype`` that is not floating-point.
    """
    _check_options(max_shard_bytes, dtype)
    saved = saved_layout(model, dtype)
    expected = model.state_dict()
    optional = set(saved.aliases) | saved.ignored
    missing = sorted(set(expected) - set(state) - optional)
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"Not the state of this {type(model).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shapes {wrong[:3]}."
        )
    # In save_pretrained's order, which its shards follow; an alias's tensor once.
    tensors = {key: state[key].detach().to(device="cpu", dtype=saved.tensors[key][0]) for key in saved.tensors}
    for alias, key in saved.aliases.items():
        if alias in state and not torch.equal(
            state[alias].detach().to(device="cpu", dtype=tensors[key].dtype), tensors[key]
        ):
            raise ValueError(
                f"{alias!r} and {key!r} are one tensor in this {type(model).__name__} (tied weights), stored once "
                f"as {key!r}, but the state gives them different values."
            )
    saver = model if dtype is None else copy.deepcopy(model).to(dtype)  # config.json's dtype is the model's
    with atomic_folder(folder) as tmp:
        saver.save_pretrained(tmp, state_dict=tensors, max_shard_size=max_shard_bytes or ONE_FILE)
        _copy_companions(companions, tmp)
    return Path(folder)


def _copy_companions(companions: Sequence[Path], folder: Path) -> None:
    for path in companions:
        shutil.copyfile(path, folder / path.name)


@contextmanager
def streamed_model_folder(
    model: nn.Module,
    folder: str | Path,
    *,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    companions: Sequence[Path] = (),
) -> Iterator[ShardedSafetensorsWriter]:
    """The folder of ``model`` (on the meta device), its weights written tensor by tensor, atomically.

    The folder holds what ``model.save_pretrained(folder, max_shard_size=max_shard_bytes)`` would write
    for the same tensors (:func:`saved_layout`, :func:`shard_layout`): ``config.json``, and one
    ``model.safetensors`` or shards and their index. ``generation_config.json`` is not written.

    Args:
        model: The model whose configuration is written as ``config.json`` and whose state dict's keys,
            shapes and dtypes the weight files are laid out for.
        folder: The folder to write (replaced when it exists, once the block ends).
        max_shard_bytes: Shards of at most this many bytes of tensors when the weights exceed it (one
            tensor larger is a shard of its own); None for one ``model.safetensors`` however large.
        dtype: The floating-point dtype floating-point tensors are stored in (each write is cast on the
            way), and ``config.json``'s ``dtype``; None: the model's.
        companions: Files copied in beside the weights, under their own names (a tokenizer's files).

    Yields a :class:`~featcal.files.safetensors_writer.ShardedSafetensorsWriter` keyed as the model's state
    dict; every stored tensor must be written before the block ends. A tied tensor's alias
    (``lm_head.weight`` with ``tie_word_embeddings``) need not be written; a write of it stores nothing
    and is refused when its bytes (in the stored dtype) differ from those of the tensor it is stored as.
    A key the model ignores on save (``_keys_to_ignore_on_save``) is accepted and dropped.
    The folder appears, with the ``config.json`` ``save_pretrained`` writes, only then: a block that
    raises leaves nothing behind. The model's configuration is not changed.

    Raises:
        ValueError: when the block ends with a tensor not written; for an alias written with other
            values than its tensor; for a ``max_shard_bytes`` that is not a positive int, a ``dtype`` that
            is not floating-point, or a model ``save_pretrained`` would store under other keys.
    """
    _check_options(max_shard_bytes, dtype)
    saved = saved_layout(model, dtype)
    files, index = shard_layout(model, saved.tensors, max_shard_bytes)
    config: Any = copy.deepcopy(model.config)
    config.dtype = str(dtype if dtype is not None else next(model.parameters()).dtype).removeprefix(
        "torch."
    )  # as save_pretrained sets
    config.architectures = [type(model).__name__]
    with atomic_folder(folder) as tmp:
        config.save_pretrained(tmp)
        if index is not None:  # as save_pretrained writes it
            (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        writer = ShardedSafetensorsWriter(tmp, files, {"format": "pt"}, aliases=saved.aliases, ignored=saved.ignored)
        try:
            yield writer
            writer.close()
        finally:
            writer.discard()
        _copy_companions(companions, tmp)
