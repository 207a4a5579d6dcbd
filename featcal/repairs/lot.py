"""LOT Merging ("Towards Minimizing Feature Drift in Model Merging: Layer-wise Task Vector Fusion for
Adaptive Knowledge Integration", Sun et al., NeurIPS 2025, arXiv 2505.23859) as a repair of a merge: the
closed forms of the paper's drift objective for the linear layers (its Eq. 9) and, by default, for the
normalisation layers (:mod:`featcal.repairs.lot_norms`); the authors' code was not read (none could be
fetched).

For every ``nn.Linear`` of the model's layers, with X_t the linear's inputs on expert t's own stream over
task t's calibration tokens (the experts' own features, layer by layer: RegMean's streams,
:mod:`featcal.merging.regmean_layers`), G_t = X_tᵀ X_t (a sum over the tokens, not a mean) and the task
vector T_t = W_t − W_0, LOT minimises the feature drift Σ_t ‖X_t (W_0 + T) − X_t (W_0 + T_t)‖²_F over T:

    T* = (Σ_t G_t)⁺ Σ_t G_t T_t,      W = W_0 + T*,

with ⁺ the Moore–Penrose pseudo-inverse (W_0 is kept where no task's input reaches), the Grams' products
in float64 so that it sees a singular Σ_t G_t's zero eigenvalues as zero (float32 rounding noise there,
inverted, ruined a decoder's first layer, whose inputs are a few token embeddings). Each normalisation the
family's adapter solves in a layer (CLIP's two LayerNorms; a decoder layer's norms that are its direct
children, RMSNorm or LayerNorm) gets the same objective's per-dimension closed form on the normalised
inputs each expert's stream gives it, for its scale and, where it has one, its shift; ``norms=False`` keeps
the linears-only variant (the merge's norms). As a repair of a merge, every tensor this does not solve
(the linears' biases, norms inside blocks, embeddings, the final norm, heads) keeps the merge's value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from featcal.checkpoint import StateDict, reading_state
from featcal.distributed import SINGLE, World
from featcal.errors import InvalidParameterError
from featcal.families.base import ModelFamily
from featcal.merging.data import MergeData
from featcal.merging.registry import HyperParameter
from featcal.merging.regmean_layers import merge_layers
from featcal.repairs.registry import REPAIRS, Repair

LOT = Repair(
    "lot", "LOT Merging", "https://arxiv.org/abs/2505.23859",
    "Re-solves each linear in closed form, T = (Σ X_tᵀX_t)⁺ Σ X_tᵀX_t T_t, and each layer's normalisations "
    "(scale, shift) per dimension, on the experts' own features of each task's calibration examples (other "
    "tensors keep the merge's values)",
    (HyperParameter("norms", bool, True),), uses_data=True, releasable=True,
)  # fmt: skip
REPAIRS.add(LOT)


def check_lot_family(family: ModelFamily) -> None:
    """Refuse, before any work, a family whose layers are not one plain stack (a T5's streams carry its
    position biases and encoder output from layer to layer), as the data-using merges refuse it.

    Raises:
        InvalidParameterError: naming the repair and the family.
    """
    if hasattr(family.adapter(), "run_layer_carried"):
        raise InvalidParameterError(
            "method", LOT.name, f"a repair defined for {family.title} models (family {family.name}: featcal or "
            f"svc): {LOT.name} streams each task's examples through one plain stack of layers, which an "
            "encoder-decoder is not",
        )  # fmt: skip


def lot_state(
    base: StateDict,
    experts: list[StateDict],
    merged: StateDict,
    data: MergeData,
    device: torch.device,
    world: World = SINGLE,
    *,
    norms: bool = True,
) -> dict[str, torch.Tensor]:
    """The merge repaired by LOT: every linear of the model's layers solved, and with ``norms`` every
    normalisation the family's adapter solves in them; every other tensor the merge's.

    Args:
        base: θ0's tensors, whose linear weights are W_0.
        experts: The experts' tensors, one per task of ``data.tasks``.
        merged: The merge's tensors, with the base's keys.
        data: The model's structure and each task's calibration examples (FeatCal's draw).
        device: Where the streams, statistics and solves live.
        world: Under torchrun, the processes whose examples' statistics are summed.
        norms: Solve the layers' normalisations too (the paper's method); False: the linears only.

    Returns:
        The repaired tensors by key, the merge's keys in its order, on the CPU, in the base's dtypes.

    Raises:
        FeatcalError: when a task has no calibration examples, or a checkpoint lacks a layer's tensor.
    """
    layers = merge_layers(
        base, experts, data, follow="experts", stems=experts, ratio=1.0, exclude=None, device=device,
        world=world, around=base, others=[merged], norms=norms,
    )  # fmt: skip
    return _completed(layers, merged)


def _completed(layers: Mapping[str, torch.Tensor], merged: StateDict) -> dict[str, torch.Tensor]:
    """``layers``' tensors, and the merge's for the keys they lack, in the merge's key order."""
    with reading_state(merged) as tensors:
        return {key: layers[key] if key in layers else tensors[key].clone() for key in tensors}
