"""Task Arithmetic: θ = θ0 + κ·Σ_t (θ_t − θ0) (Ilharco et al., 2023)."""

from __future__ import annotations

import torch

from featcal.merging.registry import MergekitForm, merge_method


@merge_method(
    "task_arithmetic",
    pretty_name="Task Arithmetic",
    reference_url="https://arxiv.org/abs/2212.04089",
    # θ0 + Σ w·τ_t with every weight κ (mergekit's normalize is off for task_arithmetic)
    mergekit=MergekitForm("task_arithmetic", lambda params: {"weight": params["scaling_factor"]}),
)
def task_arithmetic(base: torch.Tensor, task_vectors: torch.Tensor, *, scaling_factor: float = 0.3) -> torch.Tensor:
    """θ = θ0 + scaling_factor · Σ_t τ_t: the base plus the scaled sum of the task vectors.

    Args:
        base: θ0, float32.
        task_vectors: τ_t = θ_t − θ0 stacked over the tasks, float32 (T, *θ0.shape).
        scaling_factor: κ, the weight of the summed task vectors.

    Returns:
        The merged tensor, float32.
    """
    total = torch.zeros_like(base)
    for tv in task_vectors:  # task by task, in order: the published sum, to the last bit
        total += tv
    return base + scaling_factor * total
