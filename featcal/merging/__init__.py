"""Merging methods, one module each, behind a registry (see :mod:`featcal.merging.registry`).

Every module of this package is imported here, so a module that registers a method with
:func:`merge_method` is all a new method takes; :func:`get_method` looks methods up once they are.
"""

import importlib
import pkgutil

from featcal.merging.registry import METHODS, MergeMethod, Range, merge_method

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def get_method(name: str) -> MergeMethod:
    """The merging method registered as ``name``.

    Args:
        name: A registry name such as ``"task_arithmetic"`` or ``"ties"``.

    Returns:
        The method, callable as ``method(base, experts, **hyper_parameters)``.

    Raises:
        UnknownNameError: If no method has that name (``.known`` lists those that do).
    """
    return METHODS.get(name)


def available_methods() -> list[str]:
    """The names of the registered merging methods, sorted.

    Returns:
        The names :func:`get_method` accepts.
    """
    return METHODS.names()


__all__ = ["MergeMethod", "Range", "available_methods", "get_method", "merge_method"]
