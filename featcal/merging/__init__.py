"""Merging methods, one module each, behind a registry (see :mod:`featcal.merging.registry`).

Every module of this package is imported here, so a module that registers a method with
:func:`merge_method` is all a new method takes.
"""

import importlib
import pkgutil

from featcal.merging.registry import MergeMethod, Range, available_methods, get_method, merge_method

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["MergeMethod", "Range", "available_methods", "get_method", "merge_method"]
