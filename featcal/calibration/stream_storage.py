"""Where each task's feature streams live between their uses: on the compute device, or in host memory.

FeatCal keeps two feature streams per task through the layers (the merged model's and the expert's,
``[examples, tokens, width]`` float32 each). For a language model at a full calibration size they are
most of the device memory a calibration needs (8 · n · L · d bytes a task: 16 GiB for Llama-3.1-8B at
256 texts of 2048 tokens). A task's streams kept in host memory visit the device while the task's
statistics are gathered and while its merged-model stream is advanced, so the device holds one task's
streams at a time instead of every task's. The weights computed are the same either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the options (STREAM_STORAGES) are read by every --help: torch is imported only when used
    import torch

logger = logging.getLogger(__name__)

DEVICE, HOST, AUTO = "device", "host", "auto"
STREAM_STORAGES = (AUTO, DEVICE, HOST)  # --stream-storage
# ``auto`` on CUDA: tasks' streams stay on the device while all of them together take at most this share of
# its memory; the others live in host memory. One task visiting, the layer's statistics and its forwards
# take the rest (at Llama-3.1-8B's size: one task's streams 16 GiB, the rest of a layer's work 33 GiB).
AUTO_DEVICE_SHARE = 1 / 3


@dataclass
class StreamPlacement:
    """Decides, task by task, whether a task's streams live on the compute device or in host memory.

    Args:
        storage: ``device`` (every task's streams on the compute device), ``host`` (every task's in host
            memory, visiting the device when used) or ``auto`` (on CUDA: on the device while the streams
            placed there take at most ``AUTO_DEVICE_SHARE`` of its memory, the others in host memory; on
            any other device: on the device).
        device: The compute device.
        device_bytes: The device's memory (None: read from CUDA when ``auto`` needs it).

    Raises:
        ValueError: for a ``storage`` not in ``STREAM_STORAGES``.
    """

    storage: str
    device: torch.device | str
    device_bytes: int | None = None
    _kept: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.storage not in STREAM_STORAGES:
            raise ValueError(f"stream storage must be one of {STREAM_STORAGES}; got {self.storage!r}")
        import torch

        self.device = torch.device(self.device)

    def on_device(self, task: str, nbytes: int) -> bool:
        """Whether ``task``'s streams, ``nbytes`` in all, live on the compute device (else in host memory).

        Args:
            task: The task, named in the log line.
            nbytes: The bytes of the task's two streams.

        Returns:
            True to keep them on the device; False to keep them in host memory between their uses.
        """
        if self.storage == DEVICE or (self.storage == AUTO and self.device.type != "cuda"):
            return True
        if self.storage == AUTO:
            total = self.device_bytes if self.device_bytes is not None else _cuda_memory(self.device)
            if self._kept + nbytes <= AUTO_DEVICE_SHARE * total:
                self._kept += nbytes
                return True
        logger.info("FeatCal: task %s's feature streams (%.2f GiB) are kept in host memory", task, nbytes / 2**30)
        return False


def _cuda_memory(device: torch.device) -> int:
    """The memory of a CUDA device, in bytes."""
    import torch

    return torch.cuda.get_device_properties(device).total_memory
