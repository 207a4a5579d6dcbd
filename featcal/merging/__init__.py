"""Merging methods, one module each, behind a registry (see :mod:`featcal.merging.registry`)."""

from featcal.merging import task_arithmetic  # noqa: F401  (registers the method)
from featcal.merging.registry import MergeMethod, available_methods, get_method, merge_method

__all__ = ["MergeMethod", "available_methods", "get_method", "merge_method"]
