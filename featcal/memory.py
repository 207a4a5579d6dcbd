"""Peak memory of a run, per stage and for the whole process, and giving freed memory back.

Host memory is the resident set. The process's peak is the kernel's high-water mark (``VmHWM``),
never reset (so ``/usr/bin/time`` and ``wait4`` still see the whole process's peak). A stage that
raises the high-water mark gets it as its peak, exactly; any other stage gets the largest resident
set sampled every :data:`SAMPLE_INTERVAL_S` during it (a spike shorter than that can be missed, but
it stayed below an earlier stage's peak). On CUDA the allocator's peak
(``torch.cuda.max_memory_allocated``) is reset at each stage and read at its end.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from featcal.allocator import glibc

logger = logging.getLogger(__name__)

GIB = 2**30
SAMPLE_INTERVAL_S = 0.02
_STATUS = Path("/proc/self/status")
_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_peak_bytes() -> int:
    """This process's own resident-set high-water mark since it started, in bytes.

    It is the kernel's ``VmHWM`` (``/proc/self/status``) where there is one. ``ru_maxrss`` is read only
    where there is none (no ``/proc``): on Linux it is not the process's own peak when a large process
    started it, since a child started by vfork (as Python's ``subprocess`` does) keeps its parent's
    high-water mark across exec.

    Returns:
        The peak resident set, in bytes.
    """
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def host_rss_bytes() -> int | None:
    """The process's resident set now, in bytes (None where ``/proc`` is not available)."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def release_free_memory() -> None:
    """Collect garbage and hand freed memory back to the system: the C heap's free pages (glibc's
    ``malloc_trim``) and, when pyarrow is loaded, its memory pool's (``release_unused``).

    Without it, memory freed after a stage (an evaluation's batches, a dropped model) can stay in
    the process's heap and count in its resident set through the next stage. pyarrow's default pool
    (mimalloc) keeps what the datasets library freed while preparing or reading a split; a run that
    prepared four 224-px image datasets (64 train and 256 test images each) peaked 0.23 GiB lower
    with it emptied (benchmarks/README.md, "Full TA8 shape on CPU").
    """
    gc.collect()
    trim_heap()
    pyarrow = sys.modules.get("pyarrow")
    if pyarrow is not None:
        pyarrow.default_memory_pool().release_unused()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    The calibration does this before each layer's solves: the statistics' forward temporaries are
    free by then, and their pages would otherwise stay resident through the solves, where the
    calibration peaks; the calibration measured no slower with it (benchmarks/README.md, "Streaming")."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


class _Sampler(threading.Thread):
    """The largest resident set seen, polled every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, interval: float) -> None:
        super().__init__(name="featcal-memory-sampler", daemon=True)
        self.interval = interval
        self.peak = host_rss_bytes() or 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, host_rss_bytes() or 0)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, host_rss_bytes() or 0)


class MemoryMeter:
    """Peak memory of each stage of a run, and of the whole process.

    Args:
        device: The run's device; on CUDA the allocator's peaks are recorded too.
        first_stage: The name under which the peak before the first stage (imports, loading, checks)
            is recorded.
        interval: Seconds between two samples of the resident set during a stage.
    """

    def __init__(
        self, device: torch.device, first_stage: str = "start-up", interval: float = SAMPLE_INTERVAL_S
    ) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.interval = interval
        self.stages: dict[str, dict[str, float]] = {first_stage: {"host_rss_gib": host_peak_bytes() / GIB}}
        if self.cuda is not None:
            self.stages[first_stage]["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(self.cuda) / GIB
        self._cuda_peak = self.stages[first_stage].get("cuda_max_allocated_gib", 0.0)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Measure the body's peak as stage ``name`` (a repeated name keeps the larger peak)."""
        record_before = host_peak_bytes()
        sampler = _Sampler(self.interval)
        sampler.start()
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        try:
            yield
        finally:
            sampled = sampler.stop()
            record_after = host_peak_bytes()
            peaks = {"host_rss_gib": (record_after if record_after > record_before else sampled) / GIB}
            if self.cuda is not None:
                peaks["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(self.cuda) / GIB
                self._cuda_peak = max(self._cuda_peak, peaks["cuda_max_allocated_gib"])
            old = self.stages.get(name, {})
            self.stages[name] = {k: max(v, old.get(k, 0.0)) for k, v in peaks.items()}

    def report(self) -> dict[str, object]:
        """``{"host_rss_gib": …, ["cuda_max_allocated_gib": …,] "stages": {name: {…}}}``: the process's
        peaks so far and each stage's."""
        report: dict[str, object] = {"host_rss_gib": host_peak_bytes() / GIB}
        if self.cuda is not None:
            report["cuda_max_allocated_gib"] = self._cuda_peak
        report["stages"] = {k: dict(v) for k, v in self.stages.items()}
        return report
