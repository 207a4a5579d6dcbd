"""Task Arithmetic: θ = θ0 + κ·Σ_t (θ_t − θ0) (Ilharco et al., 2023)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from featcal.merging.registry import StateDict, is_mergeable, merge_method


@merge_method(
    "task_arithmetic",
    pretty_name="Task Arithmetic",
    reference_url="https://arxiv.org/abs/2212.04089",
)
def task_arithmetic(
    base: StateDict, experts: Sequence[StateDict], *, scaling_factor: float = 0.3
) -> dict[str, torch.Tensor]:
    """Add ``scaling_factor`` times the sum of the task vectors to the base, one tensor at a time."""
    merged: dict[str, torch.Tensor] = {}
    for key in base:
        theta0 = base[key]
        if not is_mergeable(theta0):
            merged[key] = theta0.clone()
            continue
        acc = theta0.to(torch.float32)
        delta = torch.zeros_like(acc)
        for expert in experts:
            delta += expert[key].to(torch.float32) - acc
        merged[key] = (acc + scaling_factor * delta).to(theta0.dtype)
    return merged
