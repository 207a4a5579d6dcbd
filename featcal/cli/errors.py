"""How the CLI words a library error: one line, with parameters named by their flags."""

from __future__ import annotations

from featcal.errors import FeatcalError, InvalidParameterError


def word_error(exc: FeatcalError) -> str:
    """The one-line message for ``exc``: run options are named by their flags (``--lambda-ratio``)."""
    if isinstance(exc, InvalidParameterError) and exc.owner is None:
        from featcal.cli.options import flag

        try:
            name = flag(exc.name)
        except KeyError:
            return exc.message
        if exc.value is None:
            return f"{name} is missing: it must be {exc.expected}."
        return f"{name} {exc.value}: invalid, it must be {exc.expected}."
    return exc.message
