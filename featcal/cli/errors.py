"""How the CLI words a library error: one line, with parameters named by the flags that set them."""

from __future__ import annotations

import re
from collections.abc import Iterable

from featcal.errors import FeatcalError, InvalidParameterError, shown

# Parameters outside the run options (the publishing API's, push_release and push_space, the demo's and the
# Space's) and the flags that set them.
NON_RUN_FLAGS = {
    "zoo_seed": "--zoo-seed",
    "repo_id": "--repo",
    "token": "--token",
    "endpoint": "--endpoint",
    "model_id": "--model-id",
    "tasks_file": "--tasks-file",
    "base_model_id": "--base-model-id",
    "host": "--host",
    "port": "--port",
}


def flag_for(name: str) -> str | None:
    """The flag that sets the parameter ``name``: a run option's, else a publishing one's."""
    from featcal.cli.options import flag

    try:
        return flag(name)
    except KeyError:
        return NON_RUN_FLAGS.get(name)


def word_error(exc: FeatcalError) -> str:
    """The one-line message for ``exc``, with parameter names worded as their flags.

    An :class:`InvalidParameterError` of a run option or publishing parameter reads
    ``--lambda-ratio '-1' is invalid: ...`` (``--ta-model-path is missing: ...`` when no value was
    given) instead of ``lambda_ratio=-1 is invalid: ...``; a parameter that a message names between
    backticks (`token`, `num_calibration_examples`) becomes its flag. Other messages are unchanged.
    """
    message = exc.message
    if isinstance(exc, InvalidParameterError) and exc.owner is None and (name := flag_for(exc.name)):
        if exc.value is None:
            message = f"{name} is missing: it must be {exc.expected}."
        else:
            message = f"{name} {shown(exc.value)} is invalid: it must be {exc.expected}."
    return re.sub(r"`([a-z_]+)`", lambda match: flag_for(match.group(1)) or match.group(0), message)


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
