"""RegMean++ (Nguyen et al., 2025) as FusionBench 0.2.33's ``RegMeanAlgorithmForCLIPPlusPlus`` defines it.

RegMean's closed form (:mod:`featcal.merging.regmean`), layer by layer in forward order, with each
expert's layer reading the **merged** model's stream: the stem is merged first (the experts' mean), each
task's examples go through it, and at every layer the Gram of each linear's input is taken with the
expert's layer run on the output of the layers merged so far; the merged layer then advances the
streams. Within a layer the tensors that are not a linear's weight get the experts' mean; the stem
(CLIP's embeddings and ``pre_layrnorm``) too. What lies after the layers (CLIP's ``post_layernorm``)
keeps the base's value: FusionBench starts from the base model and overwrites only the stem and the
layers. ``exclude_param_names_regex`` applies to the layers' tensors, as in FusionBench.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch

from featcal.distributed import World
from featcal.merging.common import StateDict
from featcal.merging.data import MergeData
from featcal.merging.registry import Range, merge_method
from featcal.merging.regmean import check_exclusion, exclusion
from featcal.merging.regmean_layers import mean_of_experts, merge_layers


@merge_method(
    "regmean_plusplus",
    pretty_name="RegMean++",
    reference_url="https://arxiv.org/abs/2508.03121",
    uses_data=True,
    check=check_exclusion,
)
def regmean_plusplus(
    base: StateDict,
    experts: Sequence[StateDict],
    data: MergeData,
    device: torch.device,
    world: World,
    *,
    reduce_non_diagonal_ratio: Annotated[float, Range(ge=0, le=1)] = 0.95,
    exclude_param_names_regex: str = "",
) -> dict[str, torch.Tensor]:
    """RegMean layer by layer on the merged model's stream; stem the mean, what follows the layers the base's.

    Args:
        base: The base's tensors; not modified.
        experts: The experts' tensors, one per task of ``data.tasks``; not modified.
        data: The model's structure and each task's calibration examples.
        device: Where the streams, statistics and solves live.
        world: Under torchrun, the processes whose examples' statistics are summed.
        reduce_non_diagonal_ratio: The factor of each Gram's off-diagonal entries (1: plain RegMean).
        exclude_param_names_regex: Layer tensors whose key it matches (``re.match``, featcal's keys such
            as ``encoder.layers.0.mlp.fc1.weight``) keep the base's value; empty: none.

    Returns:
        The merged state dict, with the base's keys and dtypes, on the CPU.
    """
    # An adapter that reads the model's layout from the model (the causal LMs') learns it from the skeleton.
    data.adapter.stem(data.skeleton(torch.device("meta")))
    prefixes = tuple(data.adapter.stem_parts().values())
    stem = {
        key: mean_of_experts(experts, key).to(base[key].dtype) if base[key].is_floating_point() else base[key].clone()
        for key in base
        if key.startswith(prefixes)
    }
    merged = merge_layers(
        base, experts, data, follow="merged", stems=[stem] * len(experts), ratio=reduce_non_diagonal_ratio,
        exclude=exclusion(exclude_param_names_regex), device=device, world=world,
    )  # fmt: skip
    merged.update(stem)
    return {key: merged[key] if key in merged else base[key].clone() for key in base}
