"""WUDI-Merging (Cheng et al., 2025) as FusionBench 0.2.33's ``wudi_merging`` defines it.

For each 2-D tensor the merged task vector τm starts at Σ_i τ_i and takes ``iterations`` Adam steps
(torch's Adam, no weight decay) on the interference loss

    L(τm) = Σ_i ‖(τm − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F.

Every other tensor (biases, norms, the class embedding, the 4-D patch embedding) gets the mean of the
task vectors. There is no scaling factor: θ = θ0 + τm.

FusionBench differentiates L with autograd, T matrix products per step. L is quadratic, so its
gradient is 2(τm A − B) with A = Σ_i τ_iᵀτ_i / ‖τ_i‖² and B = Σ_i τ_i τ_iᵀτ_i / ‖τ_i‖², computed once
per tensor: each Adam step is then one matrix product, whatever the number of tasks.
"""

from __future__ import annotations

from typing import Annotated

import torch

from featcal.merging.common import is_matrix
from featcal.merging.registry import Range, merge_method


@merge_method(
    "wudi",
    pretty_name="WUDI-Merging",
    reference_url="https://arxiv.org/abs/2503.08099",
)
def wudi(
    base: torch.Tensor,
    task_vectors: torch.Tensor,
    *,
    iterations: Annotated[int, Range(ge=0)] = 400,
    lr: Annotated[float, Range(gt=0)] = 1e-5,
) -> torch.Tensor:
    """θ = θ0 + τm, τm from Adam steps on the interference loss (2-D tensors), else the mean task vector.

    Args:
        base: θ0, float32.
        task_vectors: τ_t = θ_t − θ0 stacked over the tasks, float32 (T, *θ0.shape).
        iterations: The number of Adam steps per 2-D tensor.
        lr: Adam's learning rate.

    Returns:
        The merged tensor, float32.
    """
    if is_matrix(base):
        delta = solve(task_vectors, iterations=iterations, lr=lr)
    else:
        delta = task_vectors.sum(dim=0) / len(task_vectors)
    return base + delta


def solve(task_vectors: torch.Tensor, *, iterations: int, lr: float) -> torch.Tensor:
    """τm after ``iterations`` Adam steps on the interference loss of ``task_vectors`` (T, out, in)."""
    a, b = interference_moments(task_vectors)
    merged = task_vectors.sum(dim=0)
    optimizer = torch.optim.Adam([merged], lr=lr, weight_decay=0.0)
    merged.grad = torch.empty_like(merged)
    for _ in range(iterations):
        interference_gradient(merged, a, b, out=merged.grad)
        optimizer.step()
    merged.grad = None
    return merged


def interference_moments(task_vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with A = Σ τᵢᵀτᵢ/‖τᵢ‖² (in × in) and B = Σ τᵢ τᵢᵀτᵢ/‖τᵢ‖² (out × in).

    Task vectors that are zero on this tensor add nothing (FusionBench would divide 0 by 0 there).
    """
    _, rows, cols = task_vectors.shape
    a = torch.zeros(cols, cols, dtype=task_vectors.dtype, device=task_vectors.device)
    b = torch.zeros(rows, cols, dtype=task_vectors.dtype, device=task_vectors.device)
    for tv in task_vectors:
        norm2 = torch.linalg.vector_norm(tv).square()
        if norm2 == 0:
            continue
        gram = (tv.T @ tv) / norm2
        a += gram
        b += tv @ gram
    return a, b


def interference_loss(merged: torch.Tensor, task_vectors: torch.Tensor) -> torch.Tensor:
    """L(τm) = Σ_i ‖(τm − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F, written as FusionBench writes it."""
    norms2 = task_vectors.flatten(1).norm(dim=1).square()
    product = (merged.unsqueeze(0) - task_vectors) @ task_vectors.transpose(1, 2)
    return (product.square() / norms2.view(-1, 1, 1)).sum()


def interference_gradient(
    merged: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """∇L(τm) = 2(τm A − B), one fused matrix product (written into ``out`` when given)."""
    return torch.addmm(b, merged, a, beta=-2.0, alpha=2.0, out=out)
