"""Simple averaging: θ = (1/T) Σ_t θ_t (Wortsman et al., 2022, "Model soups")."""

from __future__ import annotations

import torch

from featcal.merging.registry import MergekitForm, merge_method


@merge_method(
    "simple_average",
    pretty_name="Simple Average",
    reference_url="https://arxiv.org/abs/2203.05482",
    mergekit=MergekitForm("linear", lambda params: {"weight": 1.0}, needs_base=False),  # normalised: the mean
)
def simple_average(experts: torch.Tensor) -> torch.Tensor:
    """θ = (1/T) Σ_t θ_t: the mean of the experts' weights.

    The experts' weights are summed as they are, not as θ0 + mean τ, which would round differently.

    Args:
        experts: θ_t stacked over the tasks, float32 (T, ...).

    Returns:
        The merged tensor, float32.
    """
    total = torch.zeros_like(experts[0])
    for theta in experts:
        total += theta
    return total / len(experts)
