"""Large temporaries of the calibration's per-layer algebra, allocated once and reused."""

from __future__ import annotations

import torch

ALIGNMENT = 64  # bytes: every buffer carved from lent memory starts on a cache line


class Workspace:
    """Buffers reused from one solve (and one layer) to the next, by name, shape and dtype.

    A ViT-B/32 fc2 system is 3072 × 3072: its temporaries are 38–75 MB, above glibc's mmap threshold,
    so each fresh one would be new pages, every first touch a page fault the kernel serves by zeroing.

    With ``lent``, buffers are carved from that memory (a flat ``uint8`` tensor) while it has room,
    and allocated afresh after. The lender must leave it untouched while the workspace's buffers are in
    use: a layer lends its joint statistics buffers, which hold nothing between their products, to the
    task folds and solves, which run only then.
    """

    def __init__(self, lent: torch.Tensor | None = None) -> None:
        if lent is not None and (lent.dtype != torch.uint8 or lent.dim() != 1):
            raise ValueError("lent memory must be a flat uint8 tensor")
        self._lent = lent
        self._used = 0
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` tensor, the same memory for every call with these arguments."""
        key = (name, tuple(shape), dtype, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = self._carve(shape, dtype, torch.device(device))
        return buffer

    def _carve(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        lent = self._lent
        if lent is None or lent.device != device or start + nbytes > lent.numel():
            return torch.empty(shape, dtype=dtype, device=device)
        self._used = start + nbytes
        return lent[start : start + nbytes].view(dtype).view(shape)


def carved_bytes(sizes: list[tuple[int, torch.dtype]]) -> int:
    """Lent memory enough for a :class:`Workspace` to carve buffers of these (element count, dtype),
    in whatever order they are asked for."""
    return sum(-(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT for numel, dtype in sizes)
