"""Task Singular Vectors merging, TSV-M (Gargiulo et al., CVPR 2025), as FusionBench defines it.

For each 2-D tensor, every task keeps the top ``⌊r/T⌋`` singular triplets of its task vector
(r = min(rows, cols), T tasks). The kept left vectors of all tasks are concatenated into U, the right
ones into V, and both are replaced by their closest orthonormal matrices (the polar factors
U_⊥ = PQᵀ from U = PΣQᵀ), which removes the interference between tasks' subspaces. The merged task
matrix is U_⊥ diag(σ) V_⊥ᵀ with the concatenated singular values σ. Other tensors get the mean of the
task vectors. θ = θ0 + α · merged.

Singular triplets that are rounding noise (below ``torch.linalg.matrix_rank``'s tolerance) are
dropped before orthogonalising; FusionBench keeps them, which only matters for rank-deficient task
vectors, where their arbitrary directions would leak into the polar factors.
"""

from __future__ import annotations

import torch

from featcal.merging.common import is_matrix, numerical_rank
from featcal.merging.registry import merge_method


@merge_method(
    "tsv",
    pretty_name="Task Singular Vectors (TSV-M)",
    reference_url="https://arxiv.org/abs/2412.00081",
)
def tsv(base: torch.Tensor, task_vectors: torch.Tensor, *, scaling_factor: float = 1.0) -> torch.Tensor:
    """θ = θ0 + scaling_factor · the TSV-M task matrix (2-D tensors) or the mean task vector (others).

    Args:
        base: θ0, float32.
        task_vectors: τ_t = θ_t − θ0 stacked over the tasks, float32 (T, *θ0.shape).
        scaling_factor: α, the weight of the merged task vector.

    Returns:
        The merged tensor, float32.
    """
    delta = merge_matrix(task_vectors) if is_matrix(base) else task_vectors.mean(dim=0)
    return base + scaling_factor * delta


def merge_matrix(task_vectors: torch.Tensor) -> torch.Tensor:
    """The TSV-M merge of ``task_vectors`` (T, rows, cols)."""
    count, rows, cols = task_vectors.shape
    per_task = int(min(rows, cols) * (1 / count))
    lefts, values, rights = [], [], []
    for tv in task_vectors:
        u, s, vh = torch.linalg.svd(tv, full_matrices=False)
        kept = min(per_task, numerical_rank(s, tv.shape))
        lefts.append(u[:, :kept])
        values.append(s[:kept])
        rights.append(vh[:kept])
    sigma = torch.cat(values)
    if sigma.numel() == 0:
        return torch.zeros(rows, cols, dtype=task_vectors.dtype, device=task_vectors.device)
    return (polar_factor(torch.cat(lefts, dim=1)) * sigma) @ polar_factor(torch.cat(rights, dim=0))


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix with orthonormal columns (or rows) closest to ``matrix`` in Frobenius norm: PQᵀ."""
    p, _, qh = torch.linalg.svd(matrix, full_matrices=False)
    return p @ qh
