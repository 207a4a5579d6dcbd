"""References: whether a model, dataset or repository reference is a local folder or a Hub id.

One rule for every reference: an existing path, or one starting with ``/``, ``./``, ``../`` or ``~``,
or one that exists relative to ``root`` (the folder of a tasks file), is local; anything else that is a
valid Hub repository id is a Hub id.
"""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from featcal.errors import InvalidParameterError

logger = logging.getLogger(__name__)

LOCAL_PREFIXES = ("/", "./", "../", "~")


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
        True when ``ref`` is not local (:func:`local_path` is None) and is a valid repository id.
    """
    return bool(ref) and local_path(ref, root) is None and valid_repo_id(str(ref))


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
