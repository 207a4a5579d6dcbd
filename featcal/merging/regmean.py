"""RegMean (Jin et al., 2023) as FusionBench 0.2.33's ``RegMeanAlgorithmForCLIP`` defines it.

Each ``nn.Linear`` weight of the model's layers is the solution of a linear regression that fits every
expert's outputs on its own task's inputs:

    W* = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ  (transposed),

with G_t the mean of x xᵀ over the tokens of task t's calibration examples, x the linear's input on
expert t's own stream, and G̃_t that Gram with its off-diagonal entries scaled by
``reduce_non_diagonal_ratio``. Every other floating-point tensor (biases, norms, the embeddings, the
final norm) is the experts' mean. The streaming is :mod:`featcal.merging.regmean_layers`'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

import torch

from featcal.distributed import World
from featcal.errors import InvalidParameterError
from featcal.merging.common import StateDict
from featcal.merging.data import MergeData
from featcal.merging.registry import Range, merge_method
from featcal.merging.regmean_layers import mean_of_experts, merge_layers


def exclusion(pattern: str) -> re.Pattern[str] | None:
    """``exclude_param_names_regex`` compiled (None for the empty text, which excludes nothing).

    Raises:
        InvalidParameterError: when the text is not a regular expression.
    """
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidParameterError(
            "exclude_param_names_regex", pattern, f"a regular expression ({exc})", owner="RegMean"
        ) from None


def check_exclusion(params: dict[str, Any]) -> None:
    """Refuse an ``exclude_param_names_regex`` that is not a regular expression, before any work."""
    exclusion(params["exclude_param_names_regex"])


@merge_method(
    "regmean",
    pretty_name="RegMean",
    reference_url="https://arxiv.org/abs/2212.09849",
    uses_data=True,
    check=check_exclusion,
)
def regmean(
    base: StateDict,
    experts: Sequence[StateDict],
    data: MergeData,
    device: torch.device,
    world: World,
    *,
    reduce_non_diagonal_ratio: Annotated[float, Range(ge=0, le=1)] = 0.95,
    exclude_param_names_regex: str = "",
) -> dict[str, torch.Tensor]:
    """W = (Σ G̃_t)⁻¹ Σ G̃_t W_tᵀ per linear, G_t its input's Gram on expert t's own stream; others the mean.

    Args:
        base: The base's tensors; not modified.
        experts: The experts' tensors, one per task of ``data.tasks``; not modified.
        data: The model's structure and each task's calibration examples.
        device: Where the streams, statistics and solves live.
        world: Under torchrun, the processes whose examples' statistics are summed.
        reduce_non_diagonal_ratio: The factor of each Gram's off-diagonal entries (1: plain RegMean).
        exclude_param_names_regex: Tensors whose key it matches (``re.match``, featcal's keys such as
            ``encoder.layers.0.mlp.fc1.weight``) keep the base's value; empty: none.

    Returns:
        The merged state dict, with the base's keys and dtypes, on the CPU.
    """
    exclude = exclusion(exclude_param_names_regex)
    merged = merge_layers(
        base, experts, data, follow="experts", stems=experts, ratio=reduce_non_diagonal_ratio,
        exclude=exclude, device=device, world=world,
    )  # fmt: skip
    for key in base:
        if key in merged:
            continue
        theta0 = base[key]
        keep = not theta0.is_floating_point() or (exclude is not None and exclude.match(key))
        merged[key] = theta0.clone() if keep else mean_of_experts(experts, key).to(theta0.dtype)
    return {key: merged[key] for key in base}
