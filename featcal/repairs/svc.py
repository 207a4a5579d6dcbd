"""Singular Value Calibration, SVC ("When Shared Knowledge Hurts: Spectral Over-Accumulation in Model
Merging", arXiv 2602.05536), as FusionBench 0.2.33 computes it by default
(``singular_value_calibration``, its vectorised implementation, in float64).

Data-free and weight-only: for every 2-D tensor, with the task updates ΔW_i = W_i − W_0 and the merge's
update ΔW = W_merge − W_0 = U diag(σ) Vᵀ, the merge's response along its r-th left singular vector is
a_r = u_rᵀ ΔW and task i's a_r^i = u_rᵀ ΔW_i. Their projection coefficient
s_r^i = ⟨a_r, a_r^i⟩ / ‖a_r^i‖² exceeds 1 where the merge over-counts what the tasks put in that
subspace; the merge's r-th singular value is scaled by γ_r = T / Σ_i max(α, s_r^i), so α floors each
coefficient and bounds γ_r by 1/α. The repaired tensor is W_0 + U diag(γ σ) Vᵀ. Other tensors keep
their merged values.

As FusionBench's: ‖a_r^i‖² is floored at 1e-12 (a task with nothing along u_r has s_r^i = 0), and a
coefficient that is not a number or is −∞ (from non-finite inputs) counts as α.
"""

from __future__ import annotations

from typing import Annotated

import torch

from featcal.merging.common import is_matrix
from featcal.options import Range
from featcal.repairs.registry import weight_repair

DENOMINATOR_FLOOR = 1e-12  # FusionBench's floor of ‖a_r^i‖²


@weight_repair("svc", pretty_name="Singular Value Calibration (SVC)", reference_url="https://arxiv.org/abs/2602.05536")
def svc(
    base: torch.Tensor, experts: torch.Tensor, merged: torch.Tensor, *, alpha: Annotated[float, Range(gt=0)] = 0.1
) -> torch.Tensor:
    """Scales down the merge's singular values where the tasks' updates pile up (2-D tensors only; data-free).

    Args:
        base: W_0, float64.
        experts: W_i stacked over the tasks, float64 (T, *W_0.shape).
        merged: W_merge, float64.
        alpha: α, the floor of each projection coefficient (γ_r ≤ 1/α); FusionBench's default 0.1.

    Returns:
        The repaired tensor, float64: ``merged`` itself when it is not 2-D.
    """
    if not is_matrix(merged):
        return merged
    return base + calibrated_update(experts - base, merged - base, alpha)


def calibration_factors(
    task_updates: torch.Tensor, merged_update: torch.Tensor, u: torch.Tensor, alpha: float
) -> torch.Tensor:
    """γ_r = T / Σ_i max(α, s_r^i) for each left singular vector u_r of the merge's update.

    Args:
        task_updates: ΔW_i stacked (T, rows, cols).
        merged_update: ΔW (rows, cols).
        u: ΔW's left singular vectors (rows, min(rows, cols)).
        alpha: α > 0.

    Returns:
        γ, one factor per singular value of ``merged_update``.
    """
    merged_responses = u.mT @ merged_update  # (R, cols): row r is a_r
    task_responses = u.mT @ task_updates  # (T, R, cols): a_r^i
    norms = (task_responses * task_responses).sum(-1).clamp_min(DENOMINATOR_FLOOR)
    coefficients = (task_responses * merged_responses).sum(-1) / norms  # (T, R)
    coefficients = torch.nan_to_num(coefficients, nan=alpha, neginf=alpha, posinf=torch.inf)
    return len(task_updates) / torch.clamp_min(coefficients, alpha).sum(0)


def calibrated_update(task_updates: torch.Tensor, merged_update: torch.Tensor, alpha: float) -> torch.Tensor:
    """ΔW with its singular values scaled by :func:`calibration_factors`: U diag(γ σ) Vᵀ.

    Args:
        task_updates: ΔW_i stacked (T, rows, cols).
        merged_update: ΔW (rows, cols).
        alpha: α > 0.

    Returns:
        The calibrated update, of ``merged_update``'s shape and dtype.
    """
    u, sigma, vh = torch.linalg.svd(merged_update, full_matrices=False)
    return (u * (calibration_factors(task_updates, merged_update, u, alpha) * sigma)) @ vh
