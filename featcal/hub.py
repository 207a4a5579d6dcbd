"""The one layer between featcal and the Hugging Face Hub.

Everything that decides whether a reference is a local folder or a Hub id, whether the Hub may or
can be reached, which token to use and how the Hub's refusals read, lives here:

* :func:`local_path` and :func:`is_hub_id` apply one rule to every model, dataset and repository
  reference: an existing path, or one starting with ``/``, ``./``, ``../`` or ``~``, or one that exists
  relative to ``root`` (the folder of a tasks file), is local; anything else that is a valid Hub
  repository id is a Hub id.
* :func:`is_offline`, :func:`hub_reachable` and :func:`resolve_model_folder` fetch models only when
  the Hub answers (configs, tokenizer files and safetensors only: never pickles).
  :func:`retry_transient` calls a download again while the Hub answers a passing refusal (429, 5xx),
  and :func:`download_failure` words why a download failed, for models and datasets alike.
* :func:`check_repo_id`, :func:`hub_api`, :func:`check_namespace`, :func:`hub_errors` and
  :func:`publishing` are what both publishers (`featcal push` and `featcal space push`) go through
  before and while writing to the Hub; :class:`HubFile`, :func:`local_files`, :func:`hub_files` and
  :func:`verify_hub_files` say what is sent and check what the Hub holds afterwards.

Errors are typed and carry the offending value (:class:`~featcal.errors.HubError` its ``repo_id`` and
HTTP ``status``, :class:`~featcal.errors.InvalidParameterError` its ``name`` and ``value``); messages
name parameters between backticks (pass `token`), never command-line flags. The token is handed to
``huggingface_hub`` and never logged or put in a message.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

from huggingface_hub import get_token
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import parse_ratelimit_headers, validate_repo_id

from featcal.errors import FeatcalError, HubError, InvalidParameterError, ModelInputError

try:
    from httpx2 import TransportError
except ImportError:  # huggingface_hub 1.x talks through httpx
    from httpx import TransportError

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

logger = logging.getLogger(__name__)

NOTHING_PUBLISHED = "Nothing was published."
LOCAL_PREFIXES = ("/", "./", "../", "~")
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]
# Files and folders whose name starts with a dot are never listed nor uploaded.
HIDDEN_PATTERNS = [".*", "*/.*"]
OFFLINE_HINT = (
    "Point at a local folder instead (a `save_pretrained` model folder or a parquet dataset repo), "
    "or download it once where the Hub is reachable and set HF_HUB_OFFLINE=1 to use the cache."
)
CHUNK = 1 << 20
# Answers of the Hub that pass (rate limit, overload, outage): a download refused so is asked again,
# after each of these waits in turn (longer when a 429 says when its limit resets, up to the cap).
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
RETRY_WAITS = (1.0, 2.0, 4.0)
MAX_RETRY_WAIT = 60.0

T = TypeVar("T")


# -- local folder or Hub id ---------------------------------------------------------------------


def local_path(ref: str | Path | None, root: str | Path | None = None) -> Path | None:
    """The local path ``ref`` names, or None when it is not a local reference (then it may be a Hub id).

    ``ref`` is local when it exists, when it starts with ``/``, ``./``, ``../`` or ``~`` (existing or
    not), or when it exists relative to ``root``. Relative references resolve against ``root`` first
    (a tasks file's folder): those found there, and those starting with ``./`` or ``../``, are returned
    resolved; others are returned as given, with ``~`` expanded.

    Args:
        ref: A path or a Hub id, as the user gave it.
        root: The folder relative references are written against, if any.

    Returns:
        The path, or None if ``ref`` is empty or names no local path.
    """
    if ref is None or str(ref) == "":
        return None
    text = str(ref)
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # "~user" of an unknown user
        path = Path(text)
    if root is not None and not path.is_absolute():
        anchored = Path(root).expanduser() / path
        if text.startswith(("./", "../")) or anchored.exists():
            return anchored.resolve()
    if text.startswith(LOCAL_PREFIXES) or path.exists():
        return path
    return None


def _valid_repo_id(repo_id: str) -> bool:
    """Whether the Hub accepts ``repo_id`` as a repository id (``namespace/name``, or a legacy bare ``name``)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def is_hub_id(ref: str | Path | None, root: str | Path | None = None) -> bool:
    """Whether ``ref`` names a Hub repository rather than a local folder.

    Args:
        ref: A path or a Hub id.
        root: The folder relative references are written against, if any (see :func:`local_path`).

    Returns:
        True when ``ref`` is not local (:func:`local_path` is None) and is a valid repository id.
    """
    return bool(ref) and local_path(ref, root) is None and _valid_repo_id(str(ref))


def check_repo_id(repo_id: str, *, name: str = "repo_id", namespace: bool = False) -> str:
    """``repo_id`` if the Hub would accept it as a repository id, else an error naming the parameter.

    Args:
        repo_id: The repository id to check.
        name: The parameter that holds it, for the error.
        namespace: Also require the ``namespace/`` part (a repository featcal creates needs one).

    Returns:
        ``repo_id``, unchanged.

    Raises:
        InvalidParameterError: ``repo_id`` lacks a required namespace or is not a valid repository id.
    """
    if namespace and "/" not in repo_id:
        raise InvalidParameterError(
            name, repo_id, f"'namespace/name' (it needs a namespace: use 'your-user-or-org/{repo_id}')"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise InvalidParameterError(
            name, repo_id, "'namespace/name' of letters, digits, '-', '_' and '.' (it is not a valid Hub repository id)"
        ) from None
    return repo_id


# -- offline mode and model downloads -----------------------------------------------------------


def is_offline() -> bool:
    """Whether the user asked huggingface_hub to stay offline (``HF_HUB_OFFLINE``).

    Returns:
        True when ``HF_HUB_OFFLINE`` is 1, true, yes or on.
    """
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}


@lru_cache(maxsize=4)
def hub_reachable(endpoint: str | None = None, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds (answer cached).

    Args:
        endpoint: The Hub's URL (default: ``HF_ENDPOINT``, else huggingface.co).
        timeout: Seconds to wait for the connection.

    Returns:
        True when the connection opened.
    """
    from huggingface_hub import constants

    url = urlparse(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def transient_refusal(exc: BaseException | None) -> HfHubHTTPError | None:
    """The passing refusal of the Hub (429, 5xx, 408) behind ``exc``, following its causes; else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, HfHubHTTPError) and exc.response is not None:
            if exc.response.status_code in TRANSIENT_STATUSES:
                return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _asked_wait(refusal: HfHubHTTPError) -> float:
    """The seconds a refusal asks to wait: a 429's rate-limit reset, or ``Retry-After``; 0 when it says nothing."""
    headers = refusal.response.headers
    limit = parse_ratelimit_headers(headers)
    if limit is not None and limit.remaining == 0:
        return limit.reset_in_seconds + 1.0
    retry_after = headers.get("Retry-After", "")
    return float(retry_after) + 1.0 if retry_after.isdigit() else 0.0


def retry_transient(call: Callable[[], T], *, what: str) -> T:
    """``call()``, called again while the Hub answers a passing refusal (429, 5xx), up to ``len(RETRY_WAITS)`` times.

    huggingface_hub retries file downloads itself, but not every request (a repository's information
    is asked once), so the whole call is made again; files it had already downloaded are not fetched
    again. Each retry waits the next of :data:`RETRY_WAITS`, or what the refusal asks for when that is
    longer; a refusal asking for more than :data:`MAX_RETRY_WAIT` is not waited for.

    Args:
        call: The download, without arguments.
        what: What it downloads, for the log (``"base model openai/clip-vit-base-patch32"``).

    Returns:
        What ``call`` returns.

    Raises:
        Exception: Whatever ``call`` raised last, or first when it is no passing refusal.
    """
    for attempt, wait in enumerate(RETRY_WAITS, start=1):
        try:
            return call()
        except Exception as exc:
            refusal = transient_refusal(exc)
            if refusal is None:
                raise
            wait = max(wait, _asked_wait(refusal))
            if wait > MAX_RETRY_WAIT:
                raise
            logger.warning(
                "The Hub answered %d for %s; retrying in %.0f s (retry %d of %d)",
                refusal.response.status_code,
                what,
                wait,
                attempt,
                len(RETRY_WAITS),
            )
            time.sleep(wait)
    return call()


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
        wait = _asked_wait(refusal)
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


def resolve_model_folder(ref: str, *, what: str = "model", cache_dir: str | Path | None = None) -> Path:
    """A local folder holding the model ``ref`` (a folder path or a Hub id), downloading it if needed.

    Only configs, tokenizer files and safetensors are fetched: pickles never are. A Hub id is fetched
    only when the Hub answers; otherwise the local cache is used. Passing refusals of the Hub (429,
    5xx) are retried (:func:`retry_transient`).

    Args:
        ref: A model folder or a Hub model id.
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
    if not _valid_repo_id(ref):
        raise ModelInputError(ref, f"The {what} {ref!r} is neither an existing folder nor a Hub id ('namespace/name').")
    from huggingface_hub import snapshot_download

    offline = is_offline() or not hub_reachable()

    def download() -> str:
        return snapshot_download(ref, allow_patterns=MODEL_FILE_PATTERNS, cache_dir=cache_dir, local_files_only=offline)

    try:
        folder = download() if offline else retry_transient(download, what=f"{what} {ref}")
    except Exception as exc:
        message = download_failure(exc, what, ref)
        if message is None:
            raise
        raise ModelInputError(ref, message) from None
    return Path(folder)


# -- publishing: token, ownership, errors -------------------------------------------------------


def hub_token(token: str | None, *, repo_id: str | None = None) -> str:
    """The token to publish with: ``token``, else HF_TOKEN, else the stored login; never logged.

    Args:
        token: The token given, if any.
        repo_id: The repository it is for (carried by the error).

    Returns:
        The token.

    Raises:
        HubError: No token anywhere.
    """
    token = token or get_token()
    if not token:
        raise HubError(
            repo_id,
            "No Hugging Face token: pass `token`, set HF_TOKEN, or log in once with `hf auth login`. "
            f"{NOTHING_PUBLISHED}",
        )
    return token


def hub_api(token: str | None = None, endpoint: str | None = None, *, repo_id: str | None = None) -> HfApi:
    """An ``HfApi`` client to publish with, once offline mode and the token have been checked.

    Both publishers get their client here, so they refuse offline mode and a missing token alike,
    before anything is staged or sent.

    Args:
        token: The token given, if any (see :func:`hub_token`).
        endpoint: The Hub's URL (default: ``HF_ENDPOINT``, else huggingface.co).
        repo_id: The repository to publish to (carried by the errors).

    Returns:
        The client; nothing has been sent yet.

    Raises:
        HubError: ``HF_HUB_OFFLINE`` is set, or there is no token.
    """
    from huggingface_hub import HfApi

    if is_offline():
        raise HubError(repo_id, f"HF_HUB_OFFLINE is set: unset it to push to the Hub. {NOTHING_PUBLISHED}")
    return HfApi(endpoint=endpoint, token=hub_token(token, repo_id=repo_id))


def check_namespace(repo_id: str, whoami: dict) -> None:
    """Refuse a repository outside the token owner's namespaces, and read-only tokens.

    Args:
        repo_id: The repository to publish to.
        whoami: The Hub's ``whoami-v2`` answer for the token.

    Raises:
        HubError: The namespace is neither the token owner's nor one of their organisations', or the
            token is read-only.
    """
    namespace, _, name = repo_id.partition("/")
    user = whoami.get("name")
    orgs = [org.get("name") for org in whoami.get("orgs") or []]
    if namespace != user and namespace not in orgs:
        owned = ", ".join([user or "?", *orgs])
        raise HubError(
            repo_id,
            f"The repository {repo_id} belongs to someone else: the token is {user!r}'s, who can push to "
            f"{owned}. Push to {user}/{name} instead (`repo_id`), or use a token of {namespace!r}. "
            f"{NOTHING_PUBLISHED}",
        )
    access = (whoami.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise HubError(
            repo_id,
            f"The token is read-only: create a token with write access at https://huggingface.co/settings/tokens "
            f"to push to {repo_id}. {NOTHING_PUBLISHED}",
        )


@contextmanager
def hub_errors(repo_id: str, endpoint: str) -> Iterator[None]:
    """Turn huggingface_hub and network errors raised inside the block into :class:`HubError`.

    Args:
        repo_id: The repository the block writes to (carried by the errors).
        endpoint: The Hub's URL, for the message when it cannot be reached.

    Yields:
        Nothing; featcal's own errors pass through unchanged.

    Raises:
        HubError: With the HTTP ``status`` of the refusal when there was one (401 rejected token,
            403 no write access, 404 repository not visible, ...).
    """
    try:
        yield
    except FeatcalError:
        raise
    except OfflineModeIsEnabled:
        raise HubError(repo_id, f"HF_HUB_OFFLINE is set: unset it to push to the Hub. {NOTHING_PUBLISHED}") from None
    except TransportError as exc:
        raise HubError(
            repo_id,
            f"Cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc}). Check the network or `endpoint`.",
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if isinstance(exc, RepositoryNotFoundError):
            raise HubError(
                repo_id,
                f"The Hub does not let this token see {repo_id}: check the id and that the token may write to it.",
                status=status,
            ) from None
        detail = exc.server_message or str(exc).splitlines()[0]
        if status == 401:
            message = (
                f"The Hub rejected the token (401: {detail}): log in again with `hf auth login` or pass a valid "
                "`token`."
            )
        elif status == 403:
            message = (
                f"The token cannot write to {repo_id} (403: {detail}): use a token with write access to "
                f"{repo_id.split('/')[0]}."
            )
        else:
            message = f"The Hub refused the push to {repo_id} ({status}: {detail})."
        raise HubError(repo_id, message, status=status) from None
    except ValueError as exc:  # e.g. README.md metadata rejected by /api/validate-yaml
        raise HubError(repo_id, f"The Hub refused the push to {repo_id}: {exc}") from None


@contextmanager
def publishing(api: HfApi, repo_id: str) -> Iterator[HfApi]:
    """Check the token may write to ``repo_id`` (``whoami``), then run the block under :func:`hub_errors`.

    Args:
        api: A client from :func:`hub_api`.
        repo_id: The repository to publish to.

    Yields:
        ``api``.

    Raises:
        HubError: The token may not write to ``repo_id``, or the Hub refused a request of the block.
    """
    with hub_errors(repo_id, api.endpoint):
        check_namespace(repo_id, api.whoami())
        yield api


# -- what is sent, and what the Hub holds -------------------------------------------------------


@dataclass(frozen=True)
class HubFile:
    """One file to publish: its path in the repository, on disk, and its size in bytes."""

    path_in_repo: str
    local: Path
    size: int

    def sha256(self) -> str:
        """The SHA-256 of the file (what the Hub lists for files stored in LFS)."""
        digest = hashlib.sha256()
        with self.local.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def git_blob_sha1(self) -> str:
        """The git object id of the file (what the Hub lists for files not stored in LFS)."""
        digest = hashlib.sha1(f"blob {self.size}\0".encode())
        with self.local.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()


def local_files(folder: str | Path) -> tuple[HubFile, ...]:
    """Every file under ``folder`` that a push uploads, sorted; hidden files and folders are skipped.

    Args:
        folder: The folder to publish.

    Returns:
        The files, each by its path in the repository (``/``-separated, relative to ``folder``).
    """
    folder = Path(folder)
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append(HubFile(rel.as_posix(), path, path.stat().st_size))
    return tuple(files)


def hub_files(
    api: HfApi, repo_id: str, *, revision: str | None = None, repo_type: str | None = None
) -> dict[str, RepoFile]:
    """The files the Hub lists in a repository at ``revision``, by path (call it under :func:`hub_errors`).

    Args:
        api: The client.
        repo_id: The repository.
        revision: A branch, tag, commit or ``refs/pr/N`` (default: ``main``).
        repo_type: ``"model"`` (default), ``"dataset"`` or ``"space"``.

    Returns:
        Each file's listing (size, ``blob_id``, ``lfs``), by its path in the repository.
    """
    from huggingface_hub.hf_api import RepoFile

    return {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, revision=revision, repo_type=repo_type, recursive=True)
        if isinstance(entry, RepoFile)
    }


def verify_hub_files(
    files: Iterable[HubFile],
    listed: dict[str, RepoFile],
    *,
    repo_id: str,
    revision: str | None = None,
    source: str = "the folder sent",
) -> None:
    """Check that the Hub lists every file sent with the same size and content hash.

    Args:
        files: The files sent.
        listed: What :func:`hub_files` returned after the commit.
        repo_id: The repository (carried by the error).
        revision: The revision listed (``None`` for ``main``).
        source: What the files came from, for the message (``"the release folder"``).

    Raises:
        HubError: A file is missing, or differs in size or hash.
    """
    problems = []
    for f in files:
        remote = listed.get(f.path_in_repo)
        if remote is None:
            problems.append(f"{f.path_in_repo} is missing")
        elif remote.size != f.size:
            problems.append(f"{f.path_in_repo} has {remote.size} bytes, {f.size} were sent")
        else:
            kind, listed_hash, local_hash = (
                ("LFS sha256", remote.lfs.sha256, f.sha256())
                if remote.lfs is not None
                else ("git oid", remote.blob_id, f.git_blob_sha1())
            )
            if listed_hash != local_hash:
                problems.append(f"{f.path_in_repo} has {kind} {listed_hash[:12]}, {local_hash[:12]} was sent")
    if problems:
        where = f"{repo_id}@{revision or 'main'}"
        raise HubError(repo_id, f"After the push, {where} differs from {source}: {'; '.join(problems)}.")
