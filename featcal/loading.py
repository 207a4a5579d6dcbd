"""Models, processors and datasets from Hub ids or local folders, with offline-aware errors.

Every loader accepts either a local folder in the Hub's own layout (a `save_pretrained` folder, a
parquet dataset repo) or a Hub id. A Hub id is fetched only when the Hub answers; otherwise the
local cache is used, and failing that the error says how to point at local folders.
"""

from __future__ import annotations

import logging
import os
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from featcal.errors import FeatcalError

logger = logging.getLogger(__name__)

MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]
OFFLINE_HINT = (
    "Point at a local folder instead (a `save_pretrained` model folder or a parquet dataset repo), "
    "or download it once where the Hub is reachable and set HF_HUB_OFFLINE=1 to use the cache."
)


def is_offline() -> bool:
    """True when the user asked huggingface_hub to stay offline."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}


@lru_cache(maxsize=4)
def hub_reachable(endpoint: str | None = None, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds."""
    from huggingface_hub import constants

    url = urlparse(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_model_folder(ref: str, *, what: str = "model", cache_dir: str | Path | None = None) -> Path:
    """A local folder holding the model ``ref`` (a folder path or a Hub id), downloading if needed.

    Only configs, tokenizer files and safetensors are fetched: pickles never are.
    """
    local = Path(ref).expanduser()
    if local.exists():
        return local
    if ref.startswith(("/", "./", "../", "~")):
        raise FeatcalError(f"The {what} folder {ref} does not exist.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = is_offline() or not hub_reachable()
    try:
        folder = snapshot_download(
            ref, allow_patterns=MODEL_FILE_PATTERNS, cache_dir=cache_dir, local_files_only=offline
        )
    except HFValidationError:
        raise FeatcalError(
            f"The {what} {ref!r} is neither an existing folder nor a Hub id ('namespace/name')."
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if is_offline() else "the Hub cannot be reached"
        raise FeatcalError(f"Cannot load {what} {ref!r}: {why} and it is not in the cache. {OFFLINE_HINT}") from None
    except RepositoryNotFoundError:
        raise FeatcalError(
            f"The {what} {ref!r} is neither a local folder nor a Hub repository you can access "
            "(check the id, or log in with `hf auth login` for a private or gated one)."
        ) from None
    except HfHubHTTPError as exc:
        raise FeatcalError(f"Cannot download {what} {ref!r}: {exc}. {OFFLINE_HINT}") from None
    return Path(folder)


def load_dataset_split(path: str, split: str, *, name: str | None = None, task: str = "?"):
    """One split of a dataset, from a local parquet repo folder or a Hub id."""
    import datasets

    local = Path(path).expanduser()
    if not local.exists() and path.startswith(("/", "./", "../", "~")):
        raise FeatcalError(f"Task {task!r}: the dataset folder {path} does not exist.")
    if not local.exists() and (is_offline() or not hub_reachable()):
        # datasets can still serve a cached copy when HF_HUB_OFFLINE=1 is set.
        if not is_offline():
            raise FeatcalError(
                f"Task {task!r}: cannot load dataset {path!r}: the Hub cannot be reached. {OFFLINE_HINT}"
            )
    try:
        return datasets.load_dataset(str(local) if local.exists() else path, name, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise FeatcalError(f"Task {task!r}: dataset {path!r} has no split {split!r} ({exc}).") from None
        raise FeatcalError(f"Task {task!r}: cannot load dataset {path!r}: {exc}") from None
    except (FileNotFoundError, ConnectionError) as exc:
        raise FeatcalError(f"Task {task!r}: cannot load dataset {path!r}: {exc}. {OFFLINE_HINT}") from None
