"""Task Arithmetic: θ = θ0 + κ·Σ_t (θ_t − θ0) (Ilharco et al., 2023)."""

from __future__ import annotations

from typing import Annotated, Any

import torch

from featcal.merging.registry import RECORDED_WHEN_SET, MergekitForm, merge_method


def is_embedding(key: str) -> bool:
    """Whether a tensor is a token embedding or the LM head, by MergeBench's rule: its name contains
    ``embed`` (in any case) or ``lm_head`` (``merging/merging_methods/utils.py``, ``vector_to_state_dict``)."""
    return "embed" in key.lower() or "lm_head" in key


def _mergekit_parameters(params: dict[str, Any]) -> dict[str, Any] | None:
    """mergekit's ``task_arithmetic`` weights every tensor: no equivalent when the embeddings stay at the base."""
    return None if params.get("keep_embeddings") else {"weight": params["scaling_factor"]}


@merge_method(
    "task_arithmetic",
    pretty_name="Task Arithmetic",
    reference_url="https://arxiv.org/abs/2212.04089",
    # θ0 + Σ w·τ_t with every weight κ (mergekit's normalize is off for task_arithmetic)
    mergekit=MergekitForm("task_arithmetic", _mergekit_parameters),
)
def task_arithmetic(
    base: torch.Tensor,
    task_vectors: torch.Tensor,
    key: str,
    *,
    scaling_factor: float = 0.3,
    keep_embeddings: Annotated[bool, RECORDED_WHEN_SET] = False,
) -> torch.Tensor:
    """θ = θ0 + scaling_factor · Σ_t τ_t: the base plus the scaled sum of the task vectors.

    Args:
        base: θ0, float32.
        task_vectors: τ_t = θ_t − θ0 stacked over the tasks, float32 (T, *θ0.shape).
        key: The tensor's name.
        scaling_factor: κ, the weight of the summed task vectors.
        keep_embeddings: Keep the token embeddings and the LM head at the base's values (tensors whose name
            contains ``embed`` or ``lm_head``), as MergeBench's Task Arithmetic does.

    Returns:
        The merged tensor, float32.
    """
    if keep_embeddings and is_embedding(key):
        return base
    total = torch.zeros_like(base)
    for tv in task_vectors:  # task by task, in order: the published sum, to the last bit
        total += tv
    return base + scaling_factor * total
