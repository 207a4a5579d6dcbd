"""The float32 arithmetic of a run on CUDA: exact float32 unless the user opts into TF32 or bf16 forwards.

PyTorch lets cuDNN convolutions (the patch embedding) run in TF32 on Ampere and newer GPUs by
default, and a user's global ``torch.set_float32_matmul_precision("high")`` would make every matmul
TF32, statistics included. featcal fixes both for the length of a run and restores them after:
``float32`` (the default) is IEEE float32 everywhere; ``tf32`` allows TF32 in CUDA matmuls and
convolutions. CPU arithmetic (oneDNN) is IEEE float32 either way.

``bf16`` runs the calibration's forward passes (the student's and experts' layers) under bfloat16
autocast, on any device, and everything else as ``float32``: the statistics, task folds and solves
never run under autocast, and evaluations stay in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

PRECISIONS = ("float32", "tf32", "bf16")  # --precision; torch is imported only where one is applied
# --output-dtype: the dtype a written model's weights are stored in, whatever the arithmetic's (float32).
# ``base`` is each family's own choice (a language model's base dtype, float32 for CLIP); a family lists
# the values it can write (``ModelFamily.output_dtypes``).
BASE_DTYPE = "base"
OUTPUT_DTYPES = (BASE_DTYPE, "float32")

T = TypeVar("T")


def forward_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of the calibration's forwards for ``precision``: bfloat16 for ``bf16``, else None.

    Raises:
        ValueError: for a precision not in ``PRECISIONS``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    import torch

    return torch.bfloat16 if precision == "bf16" else None


def without_callers_autocast(method: Callable[..., T]) -> Callable[..., T]:
    """Run a method of an object with a ``device`` attribute with autocast off on that device's type,
    whatever an enclosing ``torch.autocast`` asks for: the calibration's statistics, folds and solves
    run there, and its forwards set their own (:func:`autocast_forwards`)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs) -> T:
        import torch

        with torch.autocast(device_type=self.device.type, enabled=False):
            return method(self, *args, **kwargs)

    return wrapped


def autocast_forwards(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; nothing when ``dtype`` is None.

    Args:
        device: Where the forwards run.
        dtype: The autocast dtype (``torch.bfloat16``), or None for plain float32.
    """
    if dtype is None:
        return nullcontext()
    import torch

    # No cast cache: the calibration rewrites weights in place between forwards (each expert's layer,
    # each solved layer), and a cache kept alive by an enclosing autocast would serve stale copies.
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


@contextmanager
def fixed_precision(precision: str) -> Iterator[None]:
    """Run the body with CUDA matmuls and convolutions in ``precision``, then restore the settings.

    Args:
        precision: ``"float32"`` (IEEE), ``"tf32"``, or ``"bf16"`` (IEEE float32 outside the
            calibration's autocast forwards, see :func:`autocast_forwards`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    import torch

    tf32 = precision == "tf32"
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # torch >= 2.9
        # CUDA follows the choice; oneDNN on the CPU stays IEEE (a global "high" would make it TF32).
        settings = [(matmul, "tf32" if tf32 else "ieee"), (conv, "tf32" if tf32 else "ieee")]
        cpu = getattr(torch.backends, "mkldnn", None)
        settings += [
            (getattr(cpu, part), "ieee")
            for part in ("matmul", "conv")
            if hasattr(getattr(cpu, part, None), "fp32_precision")
        ]
        saved = [(backend, backend.fp32_precision) for backend, _ in settings]
        for backend, value in settings:
            backend.fp32_precision = value
        try:
            yield
        finally:
            for backend, value in saved:
                backend.fp32_precision = value
        return
    saved_legacy = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_legacy[:2]
        torch.set_float32_matmul_precision(saved_legacy[2])
