"""TIES-Merging (Yadav et al., 2023) as FusionBench 0.2.33 defines it: trim, elect sign, disjoint merge.

1. *Trim*: per task keep the ``top_k`` % entries of largest magnitude over the **whole** task vector
   (one threshold per task, not per tensor).
2. *Elect*: per entry, the sign of the sum of the kept values; entries whose sum is exactly zero take
   the majority of all elected signs of the model.
3. *Disjoint merge*: aggregate the kept values that agree with the elected sign (``sum``, ``mean`` or
   ``max``), scale by ``scaling_factor`` and add to the base.

Two passes keep memory bounded by one flattened task vector: pass 1 finds each task's magnitude
threshold, pass 2 merges tensor by tensor (the few entries whose sign needs the global majority are
set at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import torch

from featcal.merging.common import StateDict, is_mergeable, progress, read_task_vectors
from featcal.merging.registry import Range, merge_method


@merge_method(
    "ties",
    pretty_name="TIES-Merging",
    reference_url="https://arxiv.org/abs/2306.01708",
    whole_model=True,
)
def ties(
    base: StateDict,
    experts: Sequence[StateDict],
    device: torch.device | None = None,
    *,
    scaling_factor: float = 0.3,
    top_k: Annotated[float, Range(gt=0, le=100)] = 20.0,
    merge_func: Literal["sum", "mean", "max"] = "sum",
) -> dict[str, torch.Tensor]:
    """θ = θ0 + scaling_factor · the disjoint merge of the task vectors trimmed to their top_k % entries.

    A whole-model method: each task's magnitude threshold is taken over its whole task vector.

    Args:
        base: The base state dict; not modified.
        experts: The experts' state dicts; not modified.
        device: Where to compute (default: the CPU); the merged state dict is on the CPU.
        scaling_factor: λ, the weight of the merged task vector.
        top_k: The percentage of each task vector's entries kept (FusionBench's ``threshold``).
        merge_func: How the kept values that agree with the elected sign are aggregated.

    Returns:
        The merged state dict, with the base's keys and dtypes.
    """
    keys = [key for key in base if is_mergeable(base[key])]
    thresholds = torch.stack(
        [magnitude_threshold(base, e, keys, top_k, device) for e in progress(experts, "TIES thresholds", unit="tasks")]
    )

    merged: dict[str, torch.Tensor] = {}
    sign_total = 0
    undecided: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for key in progress(list(base), "TIES merge"):
        theta0 = base[key]
        if not is_mergeable(theta0):
            merged[key] = theta0.clone()
            continue
        base32, tvs = read_task_vectors(base, experts, key, device)
        trimmed = torch.where(tvs.abs() >= thresholds.view(-1, *[1] * theta0.dim()), tvs, 0.0)
        sign = trimmed.sum(dim=0).sign()
        sign_total += int(sign.sum(dtype=torch.int64))
        merged[key] = (base32 + scaling_factor * disjoint_merge(trimmed, sign, merge_func)).to(
            device=theta0.device, dtype=theta0.dtype
        )
        tie = ((sign == 0) & (trimmed != 0).any(dim=0)).flatten().nonzero().squeeze(1)
        if tie.numel():
            undecided.append((key, tie, trimmed.flatten(1)[:, tie], base32.flatten()[tie]))

    majority = (sign_total > 0) - (sign_total < 0)
    if majority:
        for key, index, values, theta in undecided:
            sign = torch.full(index.shape, float(majority), device=values.device)
            fixed = theta + scaling_factor * disjoint_merge(values, sign, merge_func)
            merged[key].view(-1)[index.to(merged[key].device)] = fixed.to(merged[key])
    return merged


def magnitude_threshold(
    base: StateDict, expert: StateDict, keys: Sequence[str], top_k: float, device: torch.device | None = None
) -> torch.Tensor:
    """The smallest magnitude kept when keeping the top ``top_k`` % entries of ``expert − base``.

    Entries with ``|τ| >=`` the threshold are kept (ties at the threshold are all kept, as in
    FusionBench). The flattened magnitudes of this one task vector are the only large allocation.
    """
    sizes = [base[key].numel() for key in keys]
    total = sum(sizes)
    magnitudes = torch.empty(total, dtype=torch.float32, device=device)
    offset = 0
    for key, size in zip(keys, sizes):
        tv = expert[key].to(device=device, dtype=torch.float32) - base[key].to(device=device, dtype=torch.float32)
        magnitudes[offset : offset + size] = tv.abs().flatten()
        offset += size
    kept = int(total * (top_k / 100))
    if kept >= total:
        return torch.tensor(0.0, device=device)
    return magnitudes.kthvalue(total - kept).values


def disjoint_merge(values: torch.Tensor, sign: torch.Tensor, merge_func: str) -> torch.Tensor:
    """Aggregate over dim 0 the entries of ``values`` whose sign agrees with ``sign``.

    Where ``sign`` is 0 the negative entries are taken, as FusionBench's ``torch.where(sign > 0, …)``
    does.
    """
    agrees = torch.where(sign > 0, values > 0, values < 0)
    selected = torch.where(agrees, values, 0.0)
    if merge_func == "sum":
        return selected.sum(dim=0)
    if merge_func == "mean":
        return selected.sum(dim=0) / (selected != 0).sum(dim=0).clamp(min=1)
    return selected.abs().amax(dim=0) * sign
