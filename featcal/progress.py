"""Progress of long loops: a tqdm bar on a terminal, plain log lines anywhere else.

A bar redraws itself with carriage returns and cursor codes, which only a terminal understands: in a
log file, a CI log or behind ``| tee`` they glue the bar's every state onto the next log line. So
:class:`Progress` draws a tqdm bar only when stderr is a terminal (or in a notebook). Elsewhere it
logs plain lines through the ``featcal.progress`` logger at INFO, at most one every
``FEATCAL_PROGRESS_INTERVAL`` seconds (default 10)::

    Evaluating mnist: 120/400 images (30%, 10.0 s)
    Evaluating mnist: done, 400/400 images in 31.2 s

The closing line is written for every loop shown with ``leave=True``; a transient loop
(``leave=False``, e.g. one task inside "Evaluating tasks") gets one only if it was slow enough to log
a progress line.

Progress is off when the caller says so (``enabled=False``), when ``FEATCAL_NO_PROGRESS`` is set, or
inside a :func:`disabled` block (``featcal -q`` runs its command in one).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Generic, TextIO, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

INTERVAL_ENV = "FEATCAL_PROGRESS_INTERVAL"
DISABLE_ENV = "FEATCAL_NO_PROGRESS"
DEFAULT_INTERVAL_S = 10.0

_enabled = True


@contextmanager
def disabled() -> Iterator[None]:
    """No featcal progress at all within the block, whatever the callers' ``enabled`` (``featcal -q``)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def is_enabled() -> bool:
    """Whether progress is shown at all: not inside :func:`disabled`, and ``FEATCAL_NO_PROGRESS`` not set."""
    return _enabled and os.environ.get(DISABLE_ENV) is None


def is_interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr) can show a bar that redraws in place: a terminal, or a notebook."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # a replaced or closed stream
        pass
    return "ipykernel" in sys.modules


def interval_s() -> float:
    """Seconds between two progress lines when not on a terminal: ``FEATCAL_PROGRESS_INTERVAL``, else 10."""
    return _parse_interval(os.environ.get(INTERVAL_ENV))


@functools.lru_cache(maxsize=8)
def _parse_interval(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also refuses NaN
        logger.warning("Ignoring %s=%r: not a number of seconds >= 0; using %g", INTERVAL_ENV, raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return value


def format_duration(seconds: float) -> str:
    """``4.2 s``, ``3 min 07 s`` or ``2 h 05 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress(Generic[T]):
    """The progress of one loop: a tqdm bar on a terminal, periodic log lines elsewhere, nothing when off.

    Iterate over it (``for x in Progress(items, desc=...)``) to count one per item, or use it as a
    context manager and count yourself with :meth:`update`::

        with Progress(desc="Evaluating mnist", total=len(dataset), unit="images") as bar:
            for batch in loader:
                ...
                bar.update(len(batch))

    Args:
        iterable: The items to iterate over; None to count with :meth:`update`.
        desc: What the loop does, e.g. ``"Evaluating mnist"``.
        total: The expected count (default: ``len(iterable)`` when it has one).
        unit: What is counted, plural: ``"images"``, ``"tensors"``, ``"steps"``.
        leave: Keep the finished bar on screen (on a terminal) and log the closing line (elsewhere);
            False for loops nested in another, whose end is not worth a line.
        enabled: False shows nothing (the caller's ``progress=False``).
    """

    def __init__(
        self,
        iterable: Iterable[T] | None = None,
        *,
        desc: str,
        total: int | None = None,
        unit: str = "it",
        leave: bool = True,
        enabled: bool = True,
    ) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.desc, self.total, self.unit, self.leave = iterable, desc, total, unit, leave
        self.n = 0
        self._postfix = ""
        self._bar = None
        self._logs = False
        self._logged = False
        self._closed = False
        if not (enabled and is_enabled()):
            return
        if is_interactive():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=leave)
        else:
            self._logs = True
            self._interval = interval_s()
            self._start = self._last = time.monotonic()

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError(f"Progress({self.desc!r}) has no iterable: count with update() instead")
        finished = False
        try:
            for item in self.iterable:
                yield item
                self.update()
            finished = True
        finally:
            self._finish(log_end=finished)

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._finish(log_end=exc_type is None)

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._logs:
            now = time.monotonic()
            if now - self._last >= self._interval:
                self._last, self._logged = now, True
                if logger.isEnabledFor(logging.INFO):
                    logger.info("%s", self._line(now, done=False))

    def set_postfix(self, **values: Any) -> None:
        """Show ``name=value`` pairs after the count (e.g. the current loss)."""
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix(values)

    def close(self) -> None:
        """End the display: close the bar, or log the closing line (see ``leave``). Idempotent."""
        self._finish(log_end=True)

    def _finish(self, *, log_end: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._logs and log_end and (self.leave or self._logged) and logger.isEnabledFor(logging.INFO):
            logger.info("%s", self._line(time.monotonic(), done=True))

    def _line(self, now: float, *, done: bool) -> str:
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        elapsed = format_duration(now - self._start)
        if done:
            line = f"{self.desc}: done, {count} {self.unit} in {elapsed}"
        elif self.total:
            line = f"{self.desc}: {count} {self.unit} ({100 * self.n // self.total}%, {elapsed})"
        else:
            line = f"{self.desc}: {count} {self.unit} ({elapsed})"
        return f"{line}, {self._postfix}" if self._postfix else line
