"""How the CLI words a library error: one line, with parameters named by the flags that set them."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Mapping

from featcal.errors import FeatcalError, InvalidParameterError, shown


def flag_for(name: str, flags: Mapping[str, str]) -> str | None:
    """The flag that sets the parameter ``name``: the command's own, else the run option's of that name."""
    from featcal.cli.options import flag

    if name in flags:
        return flags[name]
    try:
        return flag(name)
    except KeyError:
        return None


def word_error(exc: FeatcalError, flags: Mapping[str, str] | None = None) -> str:
    """The one-line message for ``exc``, with parameter names worded as their flags.

    An :class:`InvalidParameterError` of a parameter the command has a flag for (``flags``: parameter
    name → flag, as :func:`featcal.cli.options.command` records them) or of a run option reads
    ``--lambda-ratio '-1' is invalid: ...`` (``--ta-model-path is missing: ...`` when no value was
    given) instead of ``lambda_ratio=-1 is invalid: ...``; a parameter that a message names between
    backticks (`token`, `num_calibration_examples`) becomes its flag. Other messages are unchanged.
    """
    flags = flags or {}
    message = exc.message
    if isinstance(exc, InvalidParameterError) and exc.owner is None and (name := flag_for(exc.name, flags)):
        if exc.value is None:
            message = f"{name} is missing: it must be {exc.expected}."
        else:
            message = f"{name} {shown(exc.value)} is invalid: it must be {exc.expected}."
    return re.sub(r"`([a-z_]+)`", lambda match: flag_for(match.group(1), flags) or match.group(0), message)


# What a message must never show: Hub tokens (``hf_…``), bearer credentials a server echoed back, and
# the user:password part of a URL.
_TOKEN_LIKE = re.compile(r"\bhf_[A-Za-z0-9]{30,}")  # a Hub token: hf_ and 34 letters and digits
_BEARER = re.compile(r"(Bearer\s+)\S+", re.IGNORECASE)
_URL_CREDENTIALS = re.compile(r"(\w+://)[^/\s@]+@")


def hide_secrets(message: str, secrets: Iterable[str | None] = ()) -> str:
    """``message`` with every given secret, token-like string, bearer credential and URL password masked.

    Args:
        message: A worded error, which may quote a server's answer or a URL as the user gave it.
        secrets: Values never to print (the ``--token`` given, ``HF_TOKEN``); empty ones are ignored.

    Returns:
        The message, each secret replaced by ``***``.
    """
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        message = message.replace(secret, "***")
    message = _BEARER.sub(r"\1***", message)
    message = _URL_CREDENTIALS.sub(r"\1***@", message)
    return _TOKEN_LIKE.sub("hf_***", message)


# What a file system refuses, and what the user can do about it: one line instead of a traceback.
FILE_ERRORS = {
    errno.EACCES: "Check the path and its permissions.",
    errno.EPERM: "Check the path and its permissions.",
    errno.EROFS: "The file system is read-only: choose a path on a writable one.",
    errno.ENAMETOOLONG: "The path is longer than the system allows: choose a shorter one.",
    errno.ENOSPC: "No space is left on the device: free some, or choose a path on another one.",
    errno.EDQUOT: "The disk quota is used up: free some space, or choose a path elsewhere.",
    errno.EISDIR: "Check the path: a folder is where a file belongs.",
    errno.ENOTDIR: "Check the path: a file is where a folder belongs.",
    errno.EEXIST: "Check the path: something is already there.",
}


def file_error(exc: OSError) -> str | None:
    """The one line for a file system's refusal, naming the whole path; None for other OS errors.

    Args:
        exc: The error; its ``filename`` is made absolute (a relative one is relative to the working folder).
    """
    advice = FILE_ERRORS.get(exc.errno)
    if advice is None:
        return None
    where = f" {os.path.abspath(exc.filename)}" if exc.filename else ""
    return f"Cannot write or read{where}: {exc.strerror or exc}. {advice}"
