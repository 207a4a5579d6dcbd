"""The CUDA precision and torch threads a single-stage command computes with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from featcal.precision import fixed_precision
from featcal.threads import choose_threads, torch_threads

if TYPE_CHECKING:
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


@contextmanager
def compute_settings(spec: RunSpec, inputs: RunInputs) -> Iterator[None]:
    """The command's CUDA precision and torch threads (``--precision``, ``--threads``), restored after."""
    threads = choose_threads(spec.threads, inputs.family.hidden_size(inputs.config))
    with fixed_precision(spec.precision), torch_threads(threads):
        yield
