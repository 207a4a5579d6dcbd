"""Fault injection for the resume and multi-process tests: stop a process at a named point."""

from __future__ import annotations

import os
import signal

from featcal.errors import FeatcalError


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL (or the signal ``FEATCAL_KILL_SIGNAL`` names, e.g. ``TERM``) at
    ``name`` when ``FEATCAL_KILL_AT`` names it, or raise a :class:`~featcal.errors.FeatcalError` there
    when ``FEATCAL_FAIL_AT`` names it.

    The resume tests use it to stop a run at chosen points, the way a rented machine's loss would;
    the multi-process tests restrict it to one process with ``FEATCAL_FAULT_RANK`` (torchrun's
    ``RANK``). Unset, it costs two environment lookups.
    """
    kill, fail = os.environ.get("FEATCAL_KILL_AT"), os.environ.get("FEATCAL_FAIL_AT")
    if name not in (kill, fail):
        return
    rank = os.environ.get("FEATCAL_FAULT_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    if kill == name:  # FEATCAL_KILL_SIGNAL=TERM sends a stop request instead of a kill
        os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get('FEATCAL_KILL_SIGNAL', 'KILL')}"))
    raise FeatcalError(f"Stopped at {name} as FEATCAL_FAIL_AT asks.")
