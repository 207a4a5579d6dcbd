"""Devices: what ``--device`` names, checked against what torch sees."""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcal.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` stands for (``auto``: CUDA when torch sees a GPU, else the CPU).

    Raises:
        InvalidParameterError: for a name that is not a device, or CUDA where torch sees no GPU.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidParameterError("device", name, "auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", name, "cpu or auto, since torch sees no GPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise InvalidParameterError("device", name, f"cuda:0 to cuda:{count - 1}, since torch sees {count} GPU(s)")
    return device
