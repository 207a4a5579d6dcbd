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

from collections.abc import Sequence

import torch

from featcal.merging.common import is_matrix, numerical_rank, progress, read_task_vectors
from featcal.merging.registry import StateDict, is_mergeable, merge_method


@merge_method(
    "iso_c",
    pretty_name="Iso-C",
    reference_url="https://arxiv.org/abs/2502.04959",
)
def iso_c(base: StateDict, experts: Sequence[StateDict], *, scaling_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """θ = θ0 + ``scaling_factor`` · isotropic sum (2-D tensors) or mean task vector (others)."""
    merged: dict[str, torch.Tensor] = {}
    for key in progress(list(base), "Iso-C"):
        theta0 = base[key]
        if not is_mergeable(theta0):
            merged[key] = theta0.clone()
            continue
        base32, tvs = read_task_vectors(base, experts, key)
        delta = isotropic(tvs.sum(dim=0)) if is_matrix(theta0) else tvs.mean(dim=0)
        merged[key] = (base32 + scaling_factor * delta).to(theta0.dtype)
    return merged


def isotropic(matrix: torch.Tensor) -> torch.Tensor:
    """σ̄ U Vᵀ: ``matrix`` with every nonzero singular value replaced by their mean."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    rank = numerical_rank(s, matrix.shape)
    if rank == 0:
        return torch.zeros_like(matrix)
    return s[:rank].mean() * (u[:, :rank] @ vh[:rank])
