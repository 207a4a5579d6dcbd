"""Causal-LM model folders: checked, read lazily, loaded, built from state dicts and written.

A folder is a ``save_pretrained`` folder of an architecture featcal calibrates (``featcal architectures``:
:mod:`.architectures`)
(safetensors only, one file or shards with an index). The base's tokenizer files and generation
config travel with every merged and calibrated folder, so each loads with
``AutoModelForCausalLM``/``AutoTokenizer`` and runs in ``pipeline("text-generation")``. No folder's
code is ever run: configurations are read by transformers' own classes for the known model types.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.checkpoint import Checkpoint, check_same_architecture, load_params, read_tied_once
from featcal.errors import ModelInputError
from featcal.families.causal_lm.architectures import known
from featcal.families.likeness import check_like_base
from featcal.files.model_files import COMPANION_FILES, MODEL_CONFIG
from featcal.files.model_folders import save_model_state, saved_layout, streamed_model_folder
from featcal.files.reading import check_utf8
from featcal.files.safetensors_writer import TensorWriter
from featcal.precision import BASE_DTYPE, OUTPUT_DTYPES

logger = logging.getLogger(__name__)

# The configuration keys an expert or a merged model must share with the base (docs/causal-lm.md lists them).
LIKE_BASE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "hidden_act", "vocab_size",
)  # fmt: skip
SHARD_BYTES = 5 * 10**9  # save_pretrained's default shard size ("5GB")


def model_type(folder: Path) -> str:
    """The ``model_type`` of a folder's ``config.json``.

    Raises:
        ModelInputError: for a folder without a readable ``config.json``.
        InputError: for a ``config.json`` that is not UTF-8 text.
    """
    check_utf8(folder / MODEL_CONFIG, "Model file")
    try:
        value = json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ModelInputError(
            str(folder),
            f"{folder} is not a model folder (no readable config.json): pass a folder written by `save_pretrained`, "
            "`featcal merge` or mergekit.",
        ) from None
    return str(value)


def check_architecture_known(folder: Path) -> str:
    """The folder's model type, when featcal calibrates it (as :mod:`.architectures` records).

    Raises:
        ModelInputError: naming the model type and why it is refused, or that it is no causal LM featcal knows.
    """
    kind = model_type(folder)
    architecture = known().get(kind)
    if architecture is None:
        raise ModelInputError(
            str(folder),
            f"{folder} holds a {kind!r} model, no causal-LM architecture of the installed transformers: "
            "`featcal architectures` lists those featcal calibrates.",
        )
    if not architecture.supported:
        raise ModelInputError(
            str(folder), f"{folder}: featcal cannot calibrate {kind!r} models: {architecture.refused}."
        )
    return kind


def check_architecture_runs(folder: Path, config: Any) -> None:
    """Refuse a configuration whose layers the calibration cannot run (its tiny model, probed once).

    Raises:
        ModelInputError: naming the folder, the model type and the layer or module kind.
    """
    from featcal.families.causal_lm.adapter import UnsupportedArchitecture, describe

    try:
        describe(config)
    except UnsupportedArchitecture as exc:
        raise ModelInputError(str(folder), f"{folder}: {exc}") from None


def lm_checkpoint(folder: str | Path, name: str | None = None) -> Checkpoint:
    """The tensors of a causal-LM folder, keyed as its ``*ForCausalLM`` state dict keys them, read lazily; a tied
    tensor once, as transformers reads it (:func:`~featcal.checkpoint.read_tied_once`).

    Raises:
        ModelInputError: for a configuration that does not read, or a stored copy of a tied tensor with values
            of its own.
    """
    checkpoint = Checkpoint(folder, name=name, part="language model")
    read_tied_once(checkpoint, saved_layout(meta_model(load_config(Path(folder)))).aliases)
    return checkpoint


def model_class(config: Any) -> type[nn.Module]:
    """The ``*ForCausalLM`` class of a configuration's model type."""
    import transformers

    return getattr(transformers, known()[config.model_type].model_class)


def load_config(folder: Path) -> Any:
    """A folder's configuration, read by transformers' class for its (known) model type.

    Raises:
        ModelInputError: for an unknown model type or a configuration transformers cannot read.
    """
    from transformers import AutoConfig

    check_architecture_known(folder)
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(str(folder), f"{folder / MODEL_CONFIG} does not read ({first}).") from None
    check_architecture_runs(folder, config)
    return config


def check_lm_like_base(folder: Path, base_folder: Path, what: str) -> None:
    """Refuse a model whose configuration (:data:`LIKE_BASE_KEYS`) or tokenizer
    vocabulary differ from the base's.

    Raises:
        ModelInputError: naming the model, what differs and both values.
    """
    check_like_base(folder, base_folder, what, keys=LIKE_BASE_KEYS, read_config=load_config, tokenizer=True)


def check_lm_folder(folder: Path, base: Checkpoint | None = None) -> Checkpoint:
    """Check a causal-LM folder without loading the model: known architecture, safetensors weights (no
    pickles), finite tensors, and, when ``base`` is given, the base's tensor shapes, configuration and
    tokenizer vocabulary.

    Returns:
        The folder's tensors, read lazily.

    Raises:
        ModelInputError: naming the folder and the fix.
    """
    check_architecture_known(folder)
    checkpoint = lm_checkpoint(folder)
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
        check_lm_like_base(folder, base.path, "model")
    return checkpoint


def load_lm_folder(folder: Path, base: Checkpoint | None = None) -> nn.Module:
    """A causal LM from its folder (safetensors only), checked, in float32, in eval mode.

    Raises:
        ModelInputError: as :func:`check_lm_folder`, or when the weights do not load into the model.
    """
    check_lm_folder(folder, base)
    config = load_config(folder)
    try:
        return model_class(config).from_pretrained(str(folder), use_safetensors=True, dtype=torch.float32).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(
            str(folder), f"{folder} does not load as a {type(config).__name__} model ({first})."
        ) from None


def meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device: its state dict's keys, shapes and dtypes, no memory."""
    with torch.device("meta"):
        return model_class(config)(config)


def build_lm(config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """A model of ``config`` holding ``state`` (float32, eval mode)."""
    model = model_class(config)(config)
    model.load_state_dict(dict(state), strict=False)
    return model.eval()


def stored_dtype(config: Any, output_dtype: str = BASE_DTYPE) -> torch.dtype:
    """The dtype a written model's weights are stored in. The arithmetic is float32 whatever it is.

    Args:
        config: The base's configuration.
        output_dtype: ``base``: the base's (``config.json``'s ``dtype``, bfloat16 for most released LMs;
            float32 when it names none); ``float32``: float32.

    Returns:
        A floating-point torch dtype.

    Raises:
        ValueError: for an ``output_dtype`` not in :data:`~featcal.precision.OUTPUT_DTYPES`.
    """
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}; got {output_dtype!r}")
    if output_dtype != BASE_DTYPE:
        return getattr(torch, output_dtype)
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def save_lm(state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = BASE_DTYPE) -> Path:
    """Write ``state`` as a model folder of ``config`` (sharded as ``save_pretrained`` shards, in
    :func:`stored_dtype`, which ``config.json``'s ``dtype`` names), with the tokenizer files and generation
    config of the folder ``config`` was read from (the base's), atomically."""
    return save_model_state(
        meta_model(config),
        state,
        folder,
        max_shard_bytes=SHARD_BYTES,
        dtype=stored_dtype(config, output_dtype),
        companions=companions(config),
    )


@contextmanager
def streamed_lm(config: Any, folder: Path, *, output_dtype: str = BASE_DTYPE) -> Iterator[TensorWriter]:
    """A model folder of ``config`` written tensor by tensor (sharded, in :func:`stored_dtype`, which
    ``config.json``'s ``dtype`` names), with the tokenizer files and generation config of the folder
    ``config`` was read from (the base's), appearing whole when the block ends."""
    model = meta_model(config)
    dtype = stored_dtype(config, output_dtype)
    with streamed_model_folder(
        model, folder, max_shard_bytes=SHARD_BYTES, dtype=dtype, companions=companions(config)
    ) as writer:
        yield writer


def lm_skeleton(config: Any, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The merged model with its embedding, final norm, LM head and rotary embedding on ``device`` (read
    from ``merged``) and its decoder layers on the meta device."""
    from featcal.families.causal_lm.adapter import describe

    stack = describe(config).stack
    layers = getattr(stack.decoder(meta_model(config)), stack.layers)
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = 0
    if getattr(shallow, "layer_types", None) is not None:
        shallow.layer_types = []
    model = model_class(config)(shallow).to(device)
    load_params(model, merged, "")
    model.config = config
    getattr(stack.decoder(model), stack.layers).extend(layers)
    return model.eval()


def companions(config: Any) -> list[Path]:
    """The tokenizer files and generation config beside the folder ``config`` was read from (none when it
    was not read from a folder)."""
    source = Path(getattr(config, "name_or_path", "") or "")
    if not str(source) or not source.is_dir():
        return []
    return [source / name for name in COMPANION_FILES if (source / name).is_file()]
