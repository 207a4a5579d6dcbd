"""How the CLI words a library error: one line, with parameters named by the flags that set them."""

from __future__ import annotations

import re

from featcal.errors import FeatcalError, InvalidParameterError

# Parameters of the publishing API (push_release, push_space) and the flags that set them.
PUBLISH_FLAGS = {
    "repo_id": "--repo",
    "token": "--token",
    "endpoint": "--endpoint",
    "model_id": "--model-id",
    "tasks_file": "--tasks-file",
    "base_model_id": "--base-model-id",
}


def flag_for(name: str) -> str | None:
    """The flag that sets the parameter ``name``: a run option's, else a publishing one's."""
    from featcal.cli.options import flag

    try:
        return flag(name)
    except KeyError:
        return PUBLISH_FLAGS.get(name)


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
            message = f"{name} {exc.value!r} is invalid: it must be {exc.expected}."
    return re.sub(r"`([a-z_]+)`", lambda match: flag_for(match.group(1)) or match.group(0), message)
