"""Iso-C, isotropic merging in the common subspace (Marczak et al., 2025), as FusionBench defines it.

For each 2-D tensor the task-arithmetic sum Σ_i τ_i = U diag(σ) Vᵀ keeps its singular vectors, and
its spectrum is flattened to the mean singular value: σ̄ U Vᵀ. Other tensors get the mean of the task
vectors. θ = θ0 + α · merged.

The mean and the directions are taken over the sum's numerical rank (``torch.linalg.matrix_rank``'s
tolerance). FusionBench averages over all min(rows, cols) singular values and keeps every direction;
the two agree whenever the sum has full rank, as real task vectors do. For a rank-deficient sum
FusionBench would give weight σ̄ to arbitrary null-space directions of the SVD.
"""

from __future__ import annotations

import torch

from featcal.merging.common import is_matrix, numerical_rank
from featcal.merging.registry import merge_method


@merge_method(
    "iso_c",
    pretty_name="Iso-C",
    reference_url="https://arxiv.org/abs/2502.04959",
)
def iso_c(base: torch.Tensor, task_vectors: torch.Tensor, *, scaling_factor: float = 1.0) -> torch.Tensor:
    """θ = θ0 + scaling_factor · the isotropic sum (2-D tensors) or the mean task vector (others).

    Args:
        base: θ0, float32.
        task_vectors: τ_t = θ_t − θ0 stacked over the tasks, float32 (T, *θ0.shape).
        scaling_factor: α, the weight of the merged task vector.

    Returns:
        The merged tensor, float32.
    """
    delta = isotropic(task_vectors.sum(dim=0)) if is_matrix(base) else task_vectors.mean(dim=0)
    return base + scaling_factor * delta


def isotropic(matrix: torch.Tensor) -> torch.Tensor:
    """σ̄ U Vᵀ: ``matrix`` with every nonzero singular value replaced by their mean."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    rank = numerical_rank(s, matrix.shape)
    if rank == 0:
        return torch.zeros_like(matrix)
    return s[:rank].mean() * (u[:, :rank] @ vh[:rank])
