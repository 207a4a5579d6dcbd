"""T5 model folders: checked, read lazily, loaded, built from state dicts and written.

A folder is a ``save_pretrained`` folder of a ``T5ForConditionalGeneration`` (``model_type`` ``t5``: T5 and
FLAN-T5; safetensors only). The base's tokenizer files and generation config travel with every merged and
calibrated folder, so each loads with ``AutoModelForSeq2SeqLM``/``AutoTokenizer`` and generates (transformers
5 has no ``text2text-generation`` pipeline). Weights are written in float32: T5's feed-forward ``wo`` overflows in
float16 (transformers keeps it in float32 there, ``_keep_in_fp32_modules``), and FLAN-T5 is released in
float32.

transformers 5's ``T5Config`` sets ``tie_word_embeddings: true`` whatever it is given, and records what an older
configuration's ``tie_word_embeddings: false`` meant (T5 v1.1, FLAN-T5) as ``scale_decoder_outputs: false``: the
decoder's output is not multiplied by ``d_model ** -0.5`` before the LM head. The head is tied to the shared
embedding on load unless the checkpoint stores ``lm_head.weight`` with other values than ``shared.weight``. So a
folder's two facts are read as transformers reads them: the scaling from its configuration
(:func:`scales_decoder_outputs`), the tie from its tensors (:func:`stores_own_head`), never from a key list alone.
featcal keys a model with an LM head (``lm_head.weight``) when transformers loads it untied, and when its outputs
are not rescaled (the tied head then read under both names: such a model is written with its head, which
transformers 5 ties again on load and transformers 4 reads with the ``tie_word_embeddings: false`` its release
says); else without one, a stored copy equal to the embedding left out (:func:`has_own_head`). Every model of
one merge has the same form (a folder of another is refused naming it). No folder's code is run.
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
from featcal.errors import FeatcalError, ModelInputError
from featcal.families.causal_lm.folders import companions, model_type
from featcal.families.likeness import check_like_base
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.model_folders import save_model_state, streamed_model_folder
from featcal.files.safetensors_writer import TensorWriter

MODEL_TYPES = ("t5",)
MODEL_CLASS = "T5ForConditionalGeneration"
ADAPTER_CONFIG = "adapter_config.json"  # what marks a LoRA (PEFT) adapter's folder
# The configuration keys an expert or a merged model must share with the base (docs/seq2seq.md lists them).
LIKE_BASE_KEYS = (
    "model_type", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads", "feed_forward_proj",
    "relative_attention_num_buckets", "relative_attention_max_distance", "vocab_size", "scale_decoder_outputs",
)  # fmt: skip
SHARD_BYTES = 5 * 10**9  # save_pretrained's default shard size ("5GB")
STORED_DTYPE = torch.float32
HEAD, EMBEDDING = "lm_head.weight", "shared.weight"
OWN_HEAD = "an LM head of its own, lm_head.weight"
TIED_HEAD = "its LM head tied to the shared embedding and its decoder outputs rescaled"


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
    """The tensors of a T5 folder, keyed as its model's state dict keys them, read lazily: with
    ``lm_head.weight`` when :func:`has_own_head` says so (the shared embedding's tensor when none is stored), else
    without it (a stored copy of the embedding left out, as transformers ties it).

    Raises:
        ModelInputError: for a LoRA adapter's folder, a model that is not a T5, or a configuration that does
            not read.
    """
    config = load_config(Path(folder))  # checks first that the folder holds a whole T5
    checkpoint = Checkpoint(folder, name=name, part="encoder-decoder")
    own = not scales_decoder_outputs(config) or stores_own_head(checkpoint)
    if own and HEAD not in checkpoint and EMBEDDING in checkpoint:
        checkpoint.alias(HEAD, EMBEDDING)
    elif not own and HEAD in checkpoint:
        checkpoint.drop(HEAD)
    checkpoint.part = f"encoder-decoder ({OWN_HEAD if own else TIED_HEAD})"
    return checkpoint


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


def scales_decoder_outputs(config: Any) -> bool:
    """Whether ``T5ForConditionalGeneration.forward`` multiplies the decoder's output by ``d_model ** -0.5`` before
    the LM head (T5 v1.0), as transformers 5's ``T5Config`` records it (``scale_decoder_outputs``)."""
    return bool(getattr(config, "scale_decoder_outputs", True))


def stores_own_head(checkpoint: Checkpoint) -> bool:
    """Whether transformers 5 loads the checkpoint with an LM head of its own: it stores ``lm_head.weight`` with
    other values than ``shared.weight`` (transformers ties the two otherwise, whatever the configuration says)."""
    if HEAD not in checkpoint or EMBEDDING not in checkpoint:
        return False
    with checkpoint.reading():
        return not torch.equal(checkpoint[HEAD], checkpoint[EMBEDDING])


def has_own_head(config: Any) -> bool:
    """Whether featcal keys the models of ``config`` with an LM head (``lm_head.weight``): when their decoder
    outputs are not rescaled, or when the folder ``config`` was read from stores a head of its own."""
    if not scales_decoder_outputs(config):
        return True
    source = Path(getattr(config, "name_or_path", "") or "")
    try:
        return bool(str(source)) and source.is_dir() and stores_own_head(Checkpoint(source))
    except FeatcalError:  # a configuration read from a folder without weights
        return False


def _untie(model: nn.Module, own_head: bool) -> nn.Module:
    """``model`` with an LM head of its own when ``own_head``."""
    if own_head and model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
    return model


def meta_model(config: Any, own_head: bool) -> nn.Module:
    """The model of ``config`` on the meta device (with an LM head of its own when ``own_head``): its state dict's
    keys, shapes and dtypes, no memory."""
    from transformers import T5ForConditionalGeneration

    with torch.device("meta"):
        return _untie(T5ForConditionalGeneration(config), own_head)


def build_t5(config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """A model of ``config`` holding ``state`` (float32, eval mode), with an LM head of its own when ``state``
    has one."""
    from transformers import T5ForConditionalGeneration

    model = _untie(T5ForConditionalGeneration(config), HEAD in state)
    model.load_state_dict(dict(state), strict=False)
    return model.eval()


def check_t5_like_base(folder: Path, base_folder: Path, what: str) -> None:
    """Refuse a T5 whose configuration (:data:`LIKE_BASE_KEYS`) or tokenizer
    vocabulary differ from the base's.

    Raises:
        ModelInputError: naming the model, what differs and both values.
    """
    check_like_base(folder, base_folder, what, keys=LIKE_BASE_KEYS, read_config=load_config, tokenizer=True)


def check_t5_folder(folder: Path, base: Checkpoint | None = None) -> Checkpoint:
    """Check a T5 folder without loading the model: a T5, safetensors weights (no pickles), finite tensors, and,
    when ``base`` is given, the base's tensor shapes, configuration and tokenizer vocabulary.

    Raises:
        ModelInputError: naming the folder and the fix.
    """
    checkpoint = t5_checkpoint(folder)
    checkpoint.check_finite()
    if base is not None:
        shapes = {key: checkpoint.shape(key) for key in checkpoint}
        check_same_architecture(base, shapes, f"The model {folder}", str(folder))
        check_t5_like_base(folder, base.path, "model")
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
        meta_model(config, HEAD in state),
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
    model = meta_model(config, has_own_head(config))
    with streamed_model_folder(
        model, folder, max_shard_bytes=SHARD_BYTES, dtype=STORED_DTYPE, companions=companions(config)
    ) as writer:
        yield writer


def t5_skeleton(config: Any, merged: Checkpoint, device: torch.device) -> nn.Module:
    """The merged model with its embedding, final norms and LM head on ``device`` (read from ``merged``) and its
    encoder and decoder blocks on the meta device."""
    from transformers import T5ForConditionalGeneration

    own_head = HEAD in merged
    meta = meta_model(config, own_head)
    shallow = copy.deepcopy(config)
    shallow.num_layers = shallow.num_decoder_layers = 0
    model = _untie(T5ForConditionalGeneration(shallow), own_head).to(device)
    load_params(model, merged, "")
    model.config = config
    model.encoder.block.extend(meta.encoder.block)
    model.decoder.block.extend(meta.decoder.block)
    return model.eval()
