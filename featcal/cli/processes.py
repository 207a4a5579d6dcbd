"""How the CLI behaves as one of several processes started by torchrun.

Rank 0 speaks for the run: the other ranks log nothing, show no progress and print no results. An
error is still one line from the process that raised it, named by its rank. When every process
raises the same error (a bad input all of them see), rank 0's line is the one printed: the others
wait :data:`ERROR_GRACE_S` seconds before printing theirs, and torchrun, seeing rank 0 fail, stops
them first. A collective that fails because another process stopped waits likewise, so the line
printed is the cause, not its echo.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

ERROR_GRACE_S = 5.0
DISTRIBUTED_COMMANDS = ("run", "merge", "calibrate", "evaluate")  # the commands that run under torchrun


def silence() -> None:
    """No logging and no warnings from this process (a rank other than 0)."""
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")


def print_error(message: str, rank: int, size: int, *, defer: bool) -> None:
    """Print ``featcal: error: <message>``, naming the rank when there are several processes.

    Args:
        message: The worded error.
        rank: This process's rank.
        size: The number of processes.
        defer: Wait :data:`ERROR_GRACE_S` first, leaving the line to rank 0 (or to the process that
            caused a failed collective) when torchrun stops this one meanwhile.
    """
    if size > 1:
        if defer:
            time.sleep(ERROR_GRACE_S)
        message = f"rank {rank} of {size}: {message}"
    print(f"featcal: error: {message}", file=sys.stderr, flush=True)
