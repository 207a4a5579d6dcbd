"""Merging methods, one module each, behind a registry (see :mod:`featcal.merging.registry`)."""

from featcal.merging import (  # noqa: F401  (importing a module registers its method)
    iso_c,
    simple_average,
    task_arithmetic,
    ties,
    tsv,
    wudi,
)
from featcal.merging.registry import MergeMethod, Range, available_methods, get_method, merge_method

__all__ = ["MergeMethod", "Range", "available_methods", "get_method", "merge_method"]
