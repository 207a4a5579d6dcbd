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


class FloatingAs(Mapping[str, torch.Tensor]):
    """A state dict whose floating-point tensors read as ``dtype`` (integer buffers as they are).

    Every method returns its merged tensors in the base's dtypes; a merge whose result is kept in another
    (a bfloat16 base merged into float32 tensors) reads its base through this view. Widening is exact, so
    the float32 arithmetic sees the same values.

    Args:
        state: The state dict read (a dict of tensors or a lazily-read Checkpoint).
        dtype: The floating-point dtype its floating-point tensors read as.
    """

    def __init__(self, state: StateDict, dtype: torch.dtype) -> None:
        self.state, self.dtype = state, dtype

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.state[key]
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


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
