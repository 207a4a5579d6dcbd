"""Model downloads (configs, tokenizer files and safetensors only: never pickles), and why one failed."""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from featcal.errors import ModelInputError
from featcal.hub.connection import OFFLINE_HINT, hub_reachable, is_offline
from featcal.hub.refs import is_commit, local_path, split_revision, valid_repo_id
from featcal.hub.retries import MAX_RETRY_WAIT, RETRY_WAITS, asked_wait, retry_transient, transient_refusal

try:
    from httpx2 import TransportError
except ImportError:  # huggingface_hub 1.x talks through httpx
    from httpx import TransportError

logger = logging.getLogger(__name__)

MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


def gated_repo_message(what: str, ref: str, *, repo_type: str = "model") -> str:
    """The sentence for a gated repository ``ref`` that the token (or its absence) may not read."""
    from huggingface_hub import constants

    url = f"{constants.ENDPOINT}/{'' if repo_type == 'model' else repo_type + 's/'}{ref}"
    return (
        f"The {what} {ref!r} is a gated repository: ask for access at {url} (accept its conditions), then "
        "log in with `hf auth login` or set HF_TOKEN to a token of that account."
    )


def download_failure(exc: BaseException, what: str, ref: str, *, repo_type: str = "model") -> str | None:
    """Why downloading ``what`` (a Hub repository ``ref``) failed, in one sentence naming the fix; None if unknown.

    Covers what huggingface_hub raises on the way: a passing refusal still refused after the retries,
    a gated or missing repository, a cache that holds only part of a snapshot, and a connection that
    broke off mid-file (huggingface_hub resumes a download a few times before giving up; the partial
    file is removed, nothing half-written stays in the cache).
    """
    refusal = transient_refusal(exc)
    if refusal is not None:
        status = refusal.response.status_code
        kind = "a rate limit" if status == 429 else "the Hub is overloaded or down"
        wait = asked_wait(refusal)
        if wait > MAX_RETRY_WAIT:
            return (
                f"Cannot download {what} {ref!r}: the Hub answered {status} ({kind}) and asks to wait {wait:.0f} s: "
                "run again then; files already downloaded are kept."
            )
        return (
            f"Cannot download {what} {ref!r}: the Hub still answered {status} ({kind}) after {len(RETRY_WAITS)} "
            "retries: run again in a few minutes; files already downloaded are kept."
        )
    if isinstance(exc, GatedRepoError):
        return gated_repo_message(what, ref, repo_type=repo_type)
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"The {what} {ref!r} names a revision its repository does not have: pin a branch, tag or commit "
            "listed on the repository's page (Files and versions)."
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"The {what} {ref!r} is neither a local folder nor a Hub repository you can access "
            "(check the id, or log in with `hf auth login` for a private or gated one)."
        )
    if isinstance(exc, IncompleteSnapshotError):
        return (
            f"Only part of {what} {ref!r} is in the cache (a download was interrupted) and the Hub cannot be "
            f"asked: run once where the Hub is reachable to complete it. {OFFLINE_HINT}"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if is_offline() else "the Hub cannot be reached"
        return f"Cannot load {what} {ref!r}: {why} and it is not in the cache. {OFFLINE_HINT}"
    if isinstance(exc, TransportError) or (isinstance(exc, OSError) and "Consistency check failed" in str(exc)):
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            f"Cannot download {what} {ref!r}: the connection to the Hub broke off ({detail}): run again; files "
            "already downloaded are kept, the partial one was not."
        )
    if isinstance(exc, HfHubHTTPError):
        return f"Cannot download {what} {ref!r}: {str(exc).splitlines()[0]}. {OFFLINE_HINT}"
    return None


def snapshot_commit(folder: str | Path) -> str | None:
    """The commit a Hub cache snapshot folder holds (``.../snapshots/<commit>``); None for any other folder."""
    folder = Path(folder)
    return folder.name if folder.parent.name == "snapshots" and is_commit(folder.name) else None


def resolve_model_folder(ref: str, *, what: str = "model", cache_dir: str | Path | None = None) -> Path:
    """A local folder holding the model ``ref`` (a folder path or a Hub id), downloading it if needed.

    Only configs, tokenizer files and safetensors are fetched: pickles never are. A Hub id is fetched
    only when the Hub answers; otherwise the local cache is used. Passing refusals of the Hub (429,
    5xx) are retried (:func:`retry_transient`). A Hub id pinned to a revision (``namespace/name@rev``)
    is read at that branch, tag or commit; the folder returned is the snapshot of the commit read
    (:func:`snapshot_commit`).

    Args:
        ref: A model folder or a Hub model id, pinned to a revision or not.
        what: What the model is, for messages (``"base model"``, ``"expert for task 'mnist'"``).
        cache_dir: The Hub cache folder (default: huggingface_hub's).

    Returns:
        The folder, ``ref`` itself when it is local.

    Raises:
        ModelInputError: The folder does not exist, ``ref`` is no Hub id, or the model cannot be had
            (offline and not cached, unknown, private or gated repository, download refused or cut off).
    """
    local = local_path(ref)
    if local is not None:
        if local.exists():
            return local
        raise ModelInputError(ref, f"The {what} folder {ref} does not exist.")
    repo_id, revision = split_revision(ref)
    if not valid_repo_id(repo_id):
        raise ModelInputError(
            ref,
            f"The {what} {ref!r} is neither an existing folder nor a Hub id ('namespace/name', pinned or not "
            "with '@revision').",
        )
    from huggingface_hub import snapshot_download

    offline = is_offline() or not hub_reachable()

    def download() -> str:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=MODEL_FILE_PATTERNS,
            cache_dir=cache_dir,
            local_files_only=offline,
        )

    try:
        folder = download() if offline else retry_transient(download, what=f"{what} {ref}")
    except Exception as exc:
        message = download_failure(exc, what, ref)
        if message is None:
            raise
        raise ModelInputError(ref, message) from None
    return Path(folder)
