"""How many CPU threads torch uses for a run.

torch starts one intra-op thread per core. On models of ViT-B size that is what a run wants; on the
small models of tests, demos and experiments each matmul is too small to share, and the threads spend
their time synchronising: calibrating the tiny test fixture took 20–73 s with torch's threads on a
busy 2-core machine against 1.4 s with one (``benchmarks/threads_small_models.py`` measures it). So
unless told otherwise, a run on a model (a vision tower, a language model, a T5) narrower than
:data:`SMALL_MODEL_HIDDEN_SIZE` uses one thread, and any other run keeps torch's choice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

SMALL_MODEL_HIDDEN_SIZE = 256  # models narrower than this run on one thread by default


def choose_threads(requested: int | None, hidden_size: int) -> int:
    """The torch thread count for a run.

    Args:
        requested: The user's ``--threads``, or None for the default.
        hidden_size: The model's width (a vision tower's, a language model's hidden size, a T5's d_model).

    Returns:
        ``requested`` when given; else 1 for a model narrower than :data:`SMALL_MODEL_HIDDEN_SIZE`,
        else torch's current setting.
    """
    if requested is not None:
        return requested
    return 1 if hidden_size < SMALL_MODEL_HIDDEN_SIZE else torch.get_num_threads()


@contextmanager
def torch_threads(threads: int) -> Iterator[int]:
    """Run the body with ``threads`` torch intra-op threads, then restore the previous count.

    Args:
        threads: The thread count (>= 1).

    Yields:
        ``threads``.
    """
    saved = torch.get_num_threads()
    if threads != saved:
        logger.debug("torch threads: %d (was %d)", threads, saved)
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)
