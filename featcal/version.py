"""featcal's version, as installed (``0.0.0+unknown`` in a source tree that was not installed)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("featcal")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
