"""featcal: merge task experts, calibrate the merge with FeatCal, evaluate it and release it."""

from featcal.version import __version__

__all__ = ["__version__"]
