"""Simple averaging: θ = (1/T) Σ_t θ_t (Wortsman et al., 2022, "Model soups")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from featcal.merging.registry import StateDict, is_mergeable, merge_method


@merge_method(
    "simple_average",
    pretty_name="Simple Average",
    reference_url="https://arxiv.org/abs/2203.05482",
)
def simple_average(base: StateDict, experts: Sequence[StateDict]) -> dict[str, torch.Tensor]:
    """The mean of the experts' weights, one tensor at a time; integer buffers come from the base."""
    merged: dict[str, torch.Tensor] = {}
    for key in base:
        theta0 = base[key]
        if not is_mergeable(theta0):
            merged[key] = theta0.clone()
            continue
        total = torch.zeros(theta0.shape, dtype=torch.float32)
        for expert in experts:
            total += expert[key].to(torch.float32)
        merged[key] = (total / len(experts)).to(theta0.dtype)
    return merged
