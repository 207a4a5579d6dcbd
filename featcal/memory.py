"""Peak memory of a run, per stage and for the whole process.

Host memory is the kernel's resident-set high-water mark (``VmHWM``). On Linux it can be reset
(``/proc/self/clear_refs``), so each stage's peak is its own; where it cannot, a stage's figure is the
process's peak up to the end of that stage. On CUDA the allocator's peak
(``torch.cuda.max_memory_allocated``) is reset and read the same way.
"""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GIB = 2**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def host_peak_bytes() -> int:
    """The process's resident-set high-water mark since start (or since the last reset), in bytes."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_host_peak() -> bool:
    """Restart the high-water mark at the current RSS; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class MemoryMeter:
    """Peak memory of each stage of a run, and of the whole process.

    Args:
        device: The run's device; on CUDA the allocator's peaks are recorded too.
        first_stage: The name under which the peak before the first stage (imports, loading, checks)
            is recorded.
    """

    def __init__(self, device: torch.device, first_stage: str = "start-up") -> None:
        self.cuda = device if device.type == "cuda" else None
        self.stages: dict[str, dict[str, float]] = {first_stage: self._read()}
        self.overall = dict(self.stages[first_stage])
        self.per_stage = True

    def _read(self) -> dict[str, float]:
        peaks = {"host_rss_gib": host_peak_bytes() / GIB}
        if self.cuda is not None:
            peaks["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated(self.cuda) / GIB
        return peaks

    def _fold(self, peaks: dict[str, float]) -> None:
        for key, value in peaks.items():
            self.overall[key] = max(self.overall.get(key, 0.0), value)

    def _reset(self) -> None:
        self._fold(self._read())
        self.per_stage = _reset_host_peak() and self.per_stage
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Measure the body's peak as stage ``name`` (a repeated name keeps the larger peak)."""
        self._reset()
        try:
            yield
        finally:
            peaks = self._read()
            self._fold(peaks)
            old = self.stages.get(name, {})
            self.stages[name] = {k: max(v, old.get(k, 0.0)) for k, v in peaks.items()}

    def report(self) -> dict[str, object]:
        """``{"host_rss_gib": …, ["cuda_max_allocated_gib": …,] "stages": {name: {…}}, "per_stage": bool}``:
        the process's peaks so far and each stage's (``per_stage`` False: a stage's figure is the
        process's peak up to its end)."""
        self._fold(self._read())
        return {**self.overall, "stages": {k: dict(v) for k, v in self.stages.items()}, "per_stage": self.per_stage}
