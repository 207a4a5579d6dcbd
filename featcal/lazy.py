"""Package attributes imported on first use, so that listing commands stay fast."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name of ``exports`` from its module when first used.

    Args:
        package: The package's ``__name__``, for the error message.
        exports: Attribute name → the module that defines it.

    Returns:
        The function to assign to the package's ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name]), name)

    return __getattr__
