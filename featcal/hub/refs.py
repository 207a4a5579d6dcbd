"""References: whether a model, dataset or repository reference is a local folder or a Hub id.

One rule for every reference: an existing path, or one starting with ``/``, ``./``, ``../`` or ``~``,
or one that exists relative to ``root`` (the folder of a tasks file), is local; anything else that is a
valid Hub repository id is a Hub id. A Hub id may carry a revision after ``@`` (``namespace/name@v1.0``,
``namespace/name@<commit>``): the branch, tag or commit to read, as the Hub's own URLs name one.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from featcal.errors import InvalidParameterError

logger = logging.getLogger(__name__)

LOCAL_PREFIXES = ("/", "./", "../", "~")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION = re.compile(r"[^\s@]+")  # a branch, tag or commit: no space, no second '@'


def is_commit(revision: str | None) -> bool:
    """Whether ``revision`` is a full commit hash (40 lower-case hex digits), which names one snapshot for good."""
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def split_revision(ref: str) -> tuple[str, str | None]:
    """A Hub reference split into its repository id and its pinned revision (None when it pins none).

    Only ``namespace/name@revision`` with a valid repository id before the ``@`` is split: a local path
    is returned whole, whatever it holds.

    Args:
        ref: A Hub id, pinned or not, or a local path.

    Returns:
        ``(repo_id, revision)``; ``(ref, None)`` when ``ref`` pins no revision.
    """
    text = str(ref)
    repo, sep, revision = text.rpartition("@")
    if not sep or text.startswith(LOCAL_PREFIXES) or Path(text).expanduser().exists():
        return text, None
    if not _REVISION.fullmatch(revision) or not valid_repo_id(repo):
        return text, None
    return repo, revision


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


def valid_repo_id(repo_id: str) -> bool:
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
        True when ``ref`` is not local (:func:`local_path` is None) and is a valid repository id, pinned
        to a revision (:func:`split_revision`) or not.
    """
    return bool(ref) and local_path(ref, root) is None and valid_repo_id(split_revision(str(ref))[0])


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
