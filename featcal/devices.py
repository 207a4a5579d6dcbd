"""Devices: what ``--device`` names, checked against what torch sees, and the batch sizes chosen for them."""

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


# Test examples per batch when none is given. On the CPU a small batch is as fast and lighter: the
# ViT-B/32 shape evaluated 4 × 256 images in 74.9–82.6 s at 1.23–1.35 GiB peak RSS with 16 per batch,
# 79.7–87.8 s at 1.33 GiB with 64 and 93.3–98.9 s at 1.97–1.98 GiB with 256 (benchmarks/README.md,
# "Evaluation batch size on the CPU").
EVAL_BATCH_SIZE = {"cuda": 256, "cpu": 16}


def default_eval_batch_size(device: torch.device | str) -> int:
    """The number of test examples per batch used on ``device`` when none is asked for.

    Args:
        device: Where the evaluation runs.

    Returns:
        256 on CUDA (and any other accelerator), 16 on the CPU.
    """
    import torch

    return EVAL_BATCH_SIZE["cpu" if torch.device(device).type == "cpu" else "cuda"]
