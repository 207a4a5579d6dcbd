"""Helpers shared by the merging methods: task vectors read one tensor at a time, in float32."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import torch

from featcal.progress import Progress

T = TypeVar("T")
StateDict = Mapping[str, torch.Tensor]


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Floating-point tensors are merged; integer buffers are copied from the base."""
    return tensor.is_floating_point()


def read_task_vectors(
    base: StateDict, experts: Sequence[StateDict], key: str, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(θ0, τ)`` for one tensor: the base in float32 and the stacked task vectors ``θ_t − θ0``.

    Only this key of each expert is read, so memory stays bounded by ``len(experts)`` copies of one
    tensor; both are on ``device`` (default: where the tensors are read, the CPU).
    """
    theta0 = base[key].to(device=device, dtype=torch.float32, copy=True)
    return theta0, read_experts(experts, key, device).sub_(theta0)


def read_experts(experts: Sequence[StateDict], key: str, device: torch.device | None = None) -> torch.Tensor:
    """The experts' tensors ``key`` in float32 on ``device``, stacked along a new first dimension (T, ...)."""
    return torch.stack([expert[key].to(device=device, dtype=torch.float32) for expert in experts])


def is_matrix(tensor: torch.Tensor) -> bool:
    """The tensors the SVD and interference methods treat as linear maps: exactly two dimensions.

    As in FusionBench this includes ``position_embedding.weight`` and excludes the 4-D patch
    embedding convolution.
    """
    return tensor.dim() == 2


def progress(items: Iterable[T], desc: str, *, unit: str = "tensors") -> Iterator[T]:
    """Iterate over ``items`` showing transient progress (a bar on a terminal; see :mod:`featcal.progress`)."""
    return iter(Progress(items, desc=desc, unit=unit, leave=False))


def numerical_rank(singular_values: torch.Tensor, shape: Sequence[int]) -> int:
    """How many of the (descending) singular values of a ``shape`` matrix are not rounding noise.

    The tolerance is ``torch.linalg.matrix_rank``'s default: σ_max · max(shape) · eps.
    """
    if singular_values.numel() == 0:
        return 0
    tol = singular_values[0] * max(shape) * torch.finfo(singular_values.dtype).eps
    return int((singular_values > tol).sum())
