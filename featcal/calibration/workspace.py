"""Large temporaries of the calibration's per-layer algebra, allocated once and reused."""

from __future__ import annotations

import torch


class Workspace:
    """Buffers reused from one solve (and one layer) to the next, by name, shape and dtype.

    A ViT-B/32 fc2 system is 3072 × 3072: its temporaries are 38–75 MB, above glibc's mmap threshold,
    so each fresh one would be new pages, every first touch a page fault the kernel serves by zeroing.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` tensor, the same memory for every call with these arguments."""
        key = (name, tuple(shape), dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buffer
