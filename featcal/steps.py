"""Resumable steps over a run folder: a table of steps that one executor walks, skipping what is done.

A :class:`Step` says what it is (its ledger name), what its result depends on (its identity), what
it writes (its outputs, relative to the run folder), how to do it, and what it gives when the folder
already holds its result. :class:`StepExecutor` runs each step unless the stage ledger records it done
from the same identity with its weights intact; it measures each step's seconds and peak memory and
records it done afterwards. Skip, redo and resume are written here once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from featcal.files.faults import fault_point
from featcal.memory import MemoryMeter, release_free_memory
from featcal.runfolder.ledger import StageLedger
from featcal.runfolder.timings import seconds_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One resumable step of a run.

    Attributes:
        name: Its name in the stage ledger (``merge``, ``evaluate:ta``).
        identity: The hash of everything its result depends on, the identities of the steps it reads
            from included, so a change redoes it and everything after it.
        outputs: What it writes, relative to the run folder.
        run: Does the work; its value is the step's result.
        done: Gives the result of a step the folder already holds (None: the step gives nothing then).
        measure: The name its seconds and peak memory are recorded under (None: not measured).
        timed: Record its seconds too, not only its peak memory.
        label: What the log calls its result when it is skipped (``Merge: ta/``).
        valid: Whether the folder's copy of its result still holds, beyond the ledger's record of it (an
            evaluation's report: of the weights its model stage holds now); None: the ledger decides.
    """

    name: str
    identity: str
    outputs: tuple[str, ...]
    run: Callable[[], Any]
    done: Callable[[], Any] | None = None
    measure: str | None = None
    timed: bool = True
    label: str = ""
    valid: Callable[[], bool] | None = None


class StepExecutor:
    """Walks steps over a run folder's ledger, measuring each; see the module docstring.

    Args:
        ledger: The run folder's stage ledger (kept in memory only by processes that do not write).
        memory: The meter of each step's peak memory.
    """

    def __init__(self, ledger: StageLedger, memory: MemoryMeter) -> None:
        self.ledger = ledger
        self.memory = memory
        self.timings: dict[str, float] = {}

    def fresh(self, step: Step) -> bool:
        """Whether the folder holds ``step``'s result from the same inputs, its weights as written."""
        done = self.ledger.is_done(step.name, step.identity)
        return done and (step.valid is None or step.valid())

    @contextmanager
    def measured(self, name: str, *, timed: bool = True) -> Iterator[None]:
        """Measure the body as ``name``: its peak memory, and with ``timed`` its seconds as ``<name>_s``.
        What earlier steps freed is handed back to the system first, so it does not count here."""
        release_free_memory()
        start = time.perf_counter()
        with self.memory.stage(name):
            yield
        if timed:
            self.timings[seconds_key(name)] = time.perf_counter() - start

    def run(self, step: Step) -> Any:
        """``step``'s result: read back when the folder holds it, else computed and recorded."""
        if self.fresh(step):
            logger.info("%s is up to date (same inputs); skipped", step.label or step.name)
            return step.done() if step.done is not None else None
        if step.measure is None:
            result = step.run()
        else:
            with self.measured(step.measure, timed=step.timed):
                result = step.run()
        self.mark(step)
        return result

    def mark(self, step: Step) -> None:
        """Record ``step`` done (and stop here when a test's fault point says so)."""
        self.ledger.mark(step.name, step.identity, list(step.outputs))
        fault_point(f"after:{step.name}")

    def pending(self, steps: Sequence[Step]) -> bool:
        """Whether any of ``steps`` is still to do."""
        return any(not self.fresh(step) for step in steps)
