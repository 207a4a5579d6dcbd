"""Whether a model is fine-tuned from the base: the configuration and tokenizer vocabulary it must share.

Tensor shapes alone do not tell two models apart: a ``mistral`` and a ``llama`` of one width have the
same tensors, as do two attention layouts of one width (4 heads of 16 or 8 of 8), or a tokenizer whose
words swap ids. Each family names, in its own ``folders`` module (``LIKE_BASE_KEYS``, the list its docs give), the
configuration keys (read by transformers' own configuration class, so defaults count) that must equal the
base's in every expert and merged folder, and whether the tokenizer vocabulary must too (text families:
every word's id, and the added tokens').
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from featcal.errors import ModelInputError
from featcal.files.reading import check_model_text_files, read_text_input

TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILES = ("spiece.model", "tokenizer.model")  # a T5's and a Llama's sentencepiece model


def tokenizer_vocabulary(folder: Path) -> str | None:
    """The SHA-256 of a folder's tokenizer vocabulary: every token's id in ``tokenizer.json`` (its model's
    vocabulary and its added tokens), else the bytes of its sentencepiece model; None for a folder with
    neither.

    Raises:
        ModelInputError: for a ``tokenizer.json`` that is not UTF-8 JSON.
    """
    path = folder / TOKENIZER_FILE
    if path.is_file():
        try:
            data = json.loads(read_text_input(path, "Tokenizer file"))
        except ValueError:
            raise ModelInputError(str(folder), f"{path} is not readable JSON: save the tokenizer again.") from None
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, list):  # Unigram: [piece, score] pairs, a piece's id its place
            vocab = [entry[0] if isinstance(entry, list) and entry else entry for entry in vocab]
        added = sorted(
            (t.get("id"), t.get("content")) for t in data.get("added_tokens") or () if isinstance(t, dict)
        )  # fmt: skip
        return hashlib.sha256(json.dumps([vocab, added], sort_keys=True).encode()).hexdigest()
    for name in SENTENCEPIECE_FILES:
        if (folder / name).is_file():
            return hashlib.sha256((folder / name).read_bytes()).hexdigest()
    return None


def check_like_base(
    folder: Path,
    base_folder: Path,
    what: str,
    *,
    keys: Sequence[str],
    read_config: Callable[[Path], Any],
    tokenizer: bool,
) -> None:
    """Refuse a model whose configuration (``keys``) or tokenizer vocabulary differ from the base's.

    Args:
        folder: The expert's or merged model's folder.
        base_folder: The base's folder.
        what: What the model is, for messages (``"expert for task 'math'"``).
        keys: The configuration keys that must equal the base's (the family's ``LIKE_BASE_KEYS``).
        read_config: The family's reader of a folder's configuration.
        tokenizer: Whether the tokenizer vocabulary must be the base's (where both folders hold one).

    Raises:
        ModelInputError: naming the model, what differs and both values.
        InputError: for a configuration or tokenizer file of the model that is not UTF-8 text.
    """
    check_model_text_files(folder)
    ours, theirs = read_config(folder), read_config(base_folder)
    for key in keys:
        a, b = getattr(ours, key, None), getattr(theirs, key, None)
        if a != b:
            raise ModelInputError(
                str(folder),
                f"The {what} {folder} has {key} {a!r}, the base model {base_folder} {b!r}: merge and calibrate only "
                "models fine-tuned from the same base.",
            )
    if not tokenizer:
        return
    mine, base = tokenizer_vocabulary(folder), tokenizer_vocabulary(base_folder)
    if mine is not None and base is not None and mine != base:
        raise ModelInputError(
            str(folder),
            f"The {what} {folder} has another tokenizer vocabulary than the base model {base_folder}: its token "
            "embeddings do not line up with the base's; use models fine-tuned with the base's tokenizer.",
        )
