"""Where the benchmark zoos are cached, and how one is built there without ever leaving half a zoo behind.

Every zoo (mini8, lm5, t5x4) is a folder ``<cache>/benchmark/<key>``, its key naming the zoo, its version and
its seed. A build writes into a temporary folder beside it and renames that into place once complete, so an
interrupted build leaves no zoo, and a finished one is found by its marker file. This module imports no torch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from featcal.errors import FeatcalError

logger = logging.getLogger(__name__)

STALE_PARTIAL_SECONDS = 24 * 3600
ZOO_MARKER = "zoo.json"  # written last into a zoo: its presence means the zoo is complete
# torch CPU threads every zoo trains with, whatever the run's --threads: a zoo's last bits depend on the thread
# count (and, with several, on the machine's load), so one count makes a seed's zoo the same on every build of
# a given CPU; and the models are small, so more threads only contend (on a busy 2-core machine two threads made
# a training step of lm5's Llama 26 times slower). Recorded as the marker's ``torch_threads``; a cached zoo
# built with another count is not used, but rebuilt.
BUILD_THREADS = 1


class CacheKeyed(Protocol):
    """A zoo's configuration: anything with a cache key."""

    def cache_key(self) -> str:
        """The zoo's folder name."""
        ...


def default_cache_dir() -> Path:
    """``$FEATCAL_CACHE``, else ``$XDG_CACHE_HOME/featcal``, else ``~/.cache/featcal``."""
    explicit = os.environ.get("FEATCAL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "featcal"


def zoo_path(config: CacheKeyed, cache_dir: str | Path | None = None) -> Path:
    """Where the zoo of ``config`` lives: ``<cache>/benchmark/<name>-v<version>-seed<seed>``."""
    return Path(cache_dir or default_cache_dir()).expanduser() / "benchmark" / config.cache_key()


def marked_complete(folder: Path, key: str, version: int) -> bool:
    """Whether ``folder`` holds a finished zoo whose marker file records ``version`` under ``key``, built with
    :data:`BUILD_THREADS` torch threads.

    Args:
        folder: A zoo's folder.
        key: The marker's version field (``lm_version``).
        version: The zoo kind's current version.

    Returns:
        False for a missing or unreadable marker, another version, or another thread count.
    """
    marker = folder / ZOO_MARKER
    try:
        info = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(info, dict) and info.get(key) == version and info.get("torch_threads") == BUILD_THREADS


def build_environment(build_seconds: float) -> dict[str, Any]:
    """What a zoo's marker file records of its build: when it ended, how long it took, with how many torch
    threads (:data:`BUILD_THREADS`), on what vector instructions (:func:`cpu_capability`) and platform, with which
    torch and transformers.

    Args:
        build_seconds: The build's wall time.

    Returns:
        The fields, in the marker's order.
    """
    import platform
    from datetime import UTC, datetime

    import torch
    import transformers

    return {
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(build_seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": cpu_capability(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def cpu_capability() -> str:
    """The vector instructions torch's CPU kernels use here (``AVX512``, ``AVX2``, ``DEFAULT``…): a zoo's training
    rounds by them, so the same seed gives other weights, and another table, on a CPU with other ones (an
    AVX-512 and an AVX2-only AMD EPYC differ)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def write_marker(folder: Path, info: dict[str, Any]) -> None:
    """Write a zoo's marker file (its last file: :func:`marked_complete` then finds the zoo finished).

    Args:
        folder: The zoo's folder.
        info: What the marker records (its version under the kind's key, its config, :func:`build_environment`).
    """
    (folder / ZOO_MARKER).write_text(json.dumps(info, indent=1) + "\n")


def build_trained_zoo(
    target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool], *, force: bool = False
) -> Path:
    """:func:`build_cached` for a zoo whose build trains small models: on :data:`BUILD_THREADS` torch CPU
    threads, with the libraries' own progress bars off.

    Args:
        target: The zoo's folder (:func:`zoo_path`).
        build: Writes the whole zoo into the empty folder it is given, its marker file last.
        is_complete: Whether a folder holds a finished zoo of the current version.
        force: Rebuild even when ``target`` is complete.

    Returns:
        ``target``.

    Raises:
        FeatcalError: when the cache folder cannot be created.
    """
    from featcal.threads import torch_threads

    def build_into(folder: Path) -> None:
        with torch_threads(BUILD_THREADS), library_bars_off():
            build(folder)

    return build_cached(target, build_into, is_complete, force=force)


def build_cached(
    target: Path, build_into: Callable[[Path], None], is_complete: Callable[[Path], bool], *, force: bool = False
) -> Path:
    """``target``, built by ``build_into`` unless it already holds a complete zoo (or with ``force``).

    Args:
        target: The zoo's folder (:func:`zoo_path`).
        build_into: Writes the whole zoo into the empty folder it is given, its marker file last.
        is_complete: Whether a folder holds a finished zoo of the current version.
        force: Rebuild even when ``target`` is complete.

    Returns:
        ``target``.

    Raises:
        FeatcalError: when the cache folder cannot be created.
    """
    if is_complete(target) and not force:
        logger.info("Using the cached zoo at %s", target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FeatcalError(
            f"Cannot create the benchmark cache folder {target.parent}: {exc}. Set FEATCAL_CACHE to a writable folder."
        ) from None
    remove_stale_partials(target)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        build_into(partial)
        publish(partial, target, is_complete)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return target


def remove_stale_partials(target: Path) -> None:
    """Delete partial builds of the zoo at ``target`` left by killed processes (older than a day)."""
    now = time.time()
    for path in target.parent.glob(f".{target.name}.*"):
        if path.is_dir() and now - path.stat().st_mtime > STALE_PARTIAL_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def publish(partial: Path, target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Move a finished build into place atomically, replacing an older or unfinished one.

    Args:
        partial: The finished build.
        target: The zoo's folder.
        is_complete: Whether a folder holds a finished zoo (a concurrent build's, when the rename fails).

    Raises:
        OSError: the rename failed, and no concurrent build put a complete zoo in place.
    """
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.{os.getpid()}.old"
        os.rename(target, old)
    try:
        os.rename(partial, target)
    except OSError:
        if not is_complete(target):  # not a concurrent build that finished first
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def library_bars_off() -> Iterator[None]:
    """Silence the per-file bars of datasets and transformers (a zoo's build shows its own)."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets_on, transformers_on = datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if datasets_on:
            datasets.enable_progress_bars()
        if transformers_on:
            hf_logging.enable_progress_bar()
