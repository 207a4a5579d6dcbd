"""T5 model folders: checked, read lazily, loaded, built from state dicts and written.

A folder is a ``save_pretrained`` folder of a ``T5ForConditionalGeneration`` (``model_type`` ``t5``: T5 and
FLAN-T5; safetensors only). The base's tokenizer files and generation config travel with every merged and
calibrated folder, so each loads with ``AutoModelForSeq2SeqLM``/``AutoTokenizer`` and generates (transformers
5 has no ``text2text-generation`` pipeline). Weights are written in float32: T5's feed-forward ``wo`` overflows in
float16 (transformers keeps it in float32 there, ``_keep_in_fp32_modules``), and FLAN-T5 is released in
float32.

transformers 5 ties a freshly built T5's LM head to its embedding whatever its configuration says, and unties
it on load when the checkpoint holds a head of its own. A FLAN-T5 (T5 v1.1) has its own head (its original
configuration says ``tie_word_embeddings: false``, which transformers 5 records as ``scale_decoder_outputs:
false``); featcal builds such models with their own head too (:func:`has_own_head`). No folder's code is run.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.checkpoint import Checkpoint, check_same_architecture, load_params
from featcal.errors import ModelInputError
from featcal.families.causal_lm.folders import companions, model_type
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.model_folders import save_model_state, streamed_model_folder
from featcal.files.safetensors_writer import TensorWriter

MODEL_TYPES = ("t5",)
MODEL_CLASS = "T5ForConditionalGeneration"
ADAPTER_CONFIG = "adapter_config.json"  # what marks a LoRA (PEFT) adapter's folder
SHARD_BYTES = 5 * 10**9  # save_pretrained's default shard size ("5GB")
STORED_DTYPE = torch.float32


def check_t5_folder_kind(folder: Path) -> str:
    """The folder's model type, when it is a whole T5 model.

    Raises:
        ModelInputError: for a LoRA adapter's folder, or a model of another type.
    """
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / MODEL_CONFIG).is_file():
        raise ModelInputError(
            str(folder),
            f"{folder} is a LoRA adapter, not a model: featcal merges whole T5 models; merge the adapter into its "
            "base first (peft: PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(dir)).",
        )
    kind = model_type(folder)
    if kind not in MODEL_TYPES:
        raise ModelInputError(
            str(folder), f"{folder} holds a {kind!r} model; featcal's seq2seq family reads T5 models ('t5')."
        )
    return kind


def t5_checkpoint(folder: str | Path, name: str | None = None) -> Checkpoint:
    """The tensors of a T5 folder, keyed as its model's state dict keys them, read lazily.

    Raises:
        ModelInputError: for a LoRA adapter's folder or a model that is not a T5.
    """
    check_t5_folder_kind(Path(folder))
    return Checkpoint(folder, name=name, part="encoder-decoder")


def load_config(folder: Path) -> Any:
    """A folder's configuration, read by transformers' T5 class.

    Raises:
        ModelInputError: for a folder that is not a T5, or a configuration transformers cannot read.
    """
    from transformers import AutoConfig

    check_t5_folder_kind(folder)
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(str(folder), f"{folder / MODEL_CONFIG} does not read ({first}).") from None


def has_own_head(config: Any) -> bool:
    """Whether the models of ``config`` have an LM head of their own (FLAN-T5), not the shared embedding (T5)."""
    return not getattr(config, "scale_decoder_outputs", True) or not getattr(config, "tie_word_embeddings", True)


def _untie(model: nn.Module) -> nn.Module:
    """``model`` with an LM head of its own, when its configuration says so."""
    if has_own_head(model.config) and model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
    return model


def meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device: its state dict's keys, shapes and dtypes, no memory."""
    from transformers import T5ForConditionalGeneration

    with torch.device("meta"):
        return _untie(T5ForConditionalGeneration(config))


def build_t5(config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """A model of ``config`` holding ``state`` (float32, eval mode)."""
    from transformers import T5ForConditionalGeneration

    model = _untie(T5ForConditionalGeneration(config))
    model.load_state_dict(dict(state), strict=False)
    return model.eval()


def check_t5_folder(folder: Path, base: Checkpoint | None = None) -> Checkpoint:
    """Check a T5 folder without loading the model: a T5, safetensors weights (no pickles), finite tensors, and
    the base's tensor shapes when ``base`` is given.

    Raises:
        ModelInputError: naming the folder and the fix.
    """
    checkpoint = t5_checkpoint(folder)
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
    return checkpoint


def load_t5_folder(folder: Path, base: Checkpoint | None = None) -> nn.Module:
    """A T5 from its folder (safetensors only), checked, in float32, in eval mode.

    Raises:
        ModelInputError: as :func:`check_t5_folder`, or when the weights do not load into the model.
    """
    from transformers import T5ForConditionalGeneration

    from featcal.families.seq2seq.head_warning import untied_head_warning_off

    check_t5_folder(folder, base)
    try:
        with untied_head_warning_off():  # an LM head of its own is what the folder holds
            model = T5ForConditionalGeneration.from_pretrained(str(folder), use_safetensors=True, dtype=torch.float32)
        return model.eval()
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(str(folder), f"{folder} does not load as a T5 model ({first}).") from None


def save_t5(state: Mapping[str, torch.Tensor], config: Any, folder: Path) -> Path:
    """Write ``state`` as a model folder of ``config`` (float32, sharded as ``save_pretrained`` shards), with the
    tokenizer files and generation config of the folder ``config`` was read from (the base's), atomically."""
    return save_model_state(
        meta_model(config),
        state,
        folder,
        max_shard_bytes=SHARD_BYTES,
        dtype=STORED_DTYPE,
        companions=companions(config),
    )


@contextmanager
def streamed_t5(config: Any, folder: Path) -> Iterator[TensorWriter]:
    """A model folder of ``config`` written tensor by tensor (float32, sharded), with the base's tokenizer files
    and generation config, appearing whole when the block ends."""
    with streamed_model_folder(
        meta_model(config), folder, max_shard_bytes=SHARD_BYTES, dtype=STORED_DTYPE, companions=companions(config)
    ) as writer:
        yield writer


def t5_skeleton(config: Any, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The merged model with its embedding, final norms and LM head on ``device`` (read from ``merged``) and its
    encoder and decoder blocks on the meta device."""
    from transformers import T5ForConditionalGeneration

    meta = meta_model(config)
    shallow = copy.deepcopy(config)
    shallow.num_layers = shallow.num_decoder_layers = 0
    model = _untie(T5ForConditionalGeneration(shallow)).to(device)
    load_params(model, merged, "")
    model.config = config
    model.encoder.block.extend(meta.encoder.block)
    model.decoder.block.extend(meta.decoder.block)
    return model.eval()
