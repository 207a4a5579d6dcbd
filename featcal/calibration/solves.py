"""FeatCal's closed-form updates: pure functions of statistics, expert parameters and λ, ρ, α, ε.

Tasks are folded into a normal-equation system one at a time (``add_task``), so memory does not grow
with the number of tasks; ``solve`` then returns the calibrated parameters. The maths is in
``featcal-method.md``; symbols below follow it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from featcal.calibration.statistics import NormMoments, PairMoments, Sums
from featcal.calibration.workspace import Workspace

logger = logging.getLogger(__name__)


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """A(P) = ρ·P_m + (1−ρ)·P_0."""
    return torch.lerp(base, merged, rho)


def solve_general(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """lhs⁻¹·rhs by LU, or by the pseudo-inverse when ``lhs`` is singular."""
    try:
        return torch.linalg.solve(lhs, rhs)
    except RuntimeError:  # singular: fall back to the pseudo-inverse
        logger.warning("FeatCal linear system is singular; using the pseudo-inverse")
        return torch.linalg.pinv(lhs) @ rhs


@dataclass
class LinearSystem(Sums):
    """Σ_t s_t·C_ss,t (``lhs``), Σ_t s_t·W_t·C_τs,t (``rhs``, ``[out, in]``: the transpose of the normal
    equations' right-hand side, in the weight's layout, which is LAPACK's column-major one for the solve)
    and the bias terms, for one nn.Linear."""

    lhs: torch.Tensor
    rhs: torch.Tensor
    bias_rhs: torch.Tensor | None
    scaled_mean_student: torch.Tensor
    scale_sum: torch.Tensor

    @classmethod
    def empty(cls, out_features: int, in_features: int, has_bias: bool, *, device, dtype=torch.float64) -> LinearSystem:
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return cls(
            z(in_features, in_features),
            z(out_features, in_features),
            z(out_features) if has_bias else None,
            z(in_features),
            z(()),
        )

    def add_task(
        self,
        moments: PairMoments,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        alpha: float,
        eps: float,
        workspace: Workspace | None = None,
    ) -> None:
        """Fold one task's statistics and expert parameters (W_t, b_t) into the system.

        ``moments`` is a :class:`LinearMoments` or a :class:`ProjectedLinearMoments`; the product
        W_t·C_τs runs in W_t's dtype (float32 at least), its temporaries in ``workspace`` when given,
        and is summed in the system's dtype.
        """
        dtype, device = self.lhs.dtype, self.lhs.device
        w_t = weight.to(device=device)
        sum_w = moments.sum_w.to(dtype)
        norm = moments.sum_ss.to(dtype).norm() / sum_w
        scale = 1.0 / norm.clamp_min(eps)
        self.lhs.addcmul_(moments.sum_ss, scale / sum_w)
        self.rhs.addcmul_(moments.teacher_rhs(alpha, w_t, workspace), scale)
        if self.bias_rhs is not None:
            b_t = bias.to(device=device, dtype=dtype)
            self.bias_rhs.addcmul_(b_t + moments.teacher_output_mean(alpha, w_t).to(dtype), scale)
        self.scaled_mean_student.addcmul_(moments.mean_student().to(dtype), scale)
        self.scale_sum += scale

    def solve(
        self,
        anchor_weight: torch.Tensor,
        anchor_bias: torch.Tensor | None,
        *,
        lam: float,
        eps: float,
        workspace: Workspace | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W = argmin Σ_t s_t E‖W x_s − W_t x_τ‖² + λ‖W − A(W)‖², then b given W, in the system's dtype.

        Args:
            anchor_weight: A(W), ``[out, in]``.
            anchor_bias: A(b), or None for a linear without bias.
            lam: λ, the pull towards the anchor.
            eps: ε, added to the diagonal with λ.
            workspace: Buffers to reuse for the factorisation (fresh ones when None).

        Returns:
            The weight ``[out, in]`` and the bias (or None).
        """
        dtype, device = self.lhs.dtype, self.lhs.device
        # [out, in] row-major: its transpose, the right-hand side [in, out], is column-major as LAPACK reads it
        rhs = torch.add(self.rhs, anchor_weight.to(device=device, dtype=dtype), alpha=lam)
        weight_t = _cholesky_solve(self.lhs, lam + eps, rhs.mT, workspace or Workspace())
        if weight_t is None:  # not positive definite: LU, then the pseudo-inverse
            system = self.lhs.clone()
            system.diagonal().add_(lam + eps)
            weight_t = solve_general(system, rhs.mT)
        weight = weight_t.mT
        if self.bias_rhs is None:
            return weight, None
        a_b = anchor_bias.to(device=device, dtype=dtype)
        bias = (self.bias_rhs - weight @ self.scaled_mean_student + lam * a_b) / (self.scale_sum + lam)
        return weight, bias


def _cholesky_solve(lhs: torch.Tensor, ridge: float, rhs: torch.Tensor, workspace: Workspace) -> torch.Tensor | None:
    """(lhs + ridge·I)⁻¹·rhs by Cholesky in one ``workspace`` buffer; None when the factorisation fails.

    ``lhs`` is symmetric, and only its upper triangle is read. It is copied as it is (row by row, no
    transposition) into a buffer whose transpose is column-major (LAPACK's layout): that view holds lhsᵀ,
    whose lower triangle is lhs's upper one, and is factorised there as L·Lᵀ, in place (the output aliases
    the input on purpose): no transposed copy, and no fresh pages for a 3072² system every layer
    (benchmarks/README.md, "Per phase").
    """
    n = lhs.shape[0]
    buffer = workspace.get("factor", (n, n), lhs.dtype, lhs.device)
    buffer.copy_(lhs)
    factor = buffer.mT
    factor.diagonal().add_(ridge)
    info = workspace.get("info", (), torch.int32, lhs.device)
    torch.linalg.cholesky_ex(factor, upper=False, out=(factor, info))
    if info.item() != 0:
        return None
    return torch.cholesky_solve(rhs, factor, upper=False)


@dataclass
class LayerNormSystem(Sums):
    """Per-dimension sums of the 2×2 LayerNorm affine system, for one nn.LayerNorm."""

    energy: torch.Tensor
    mean: torch.Tensor
    count: torch.Tensor
    rhs_gamma: torch.Tensor
    rhs_beta: torch.Tensor

    @classmethod
    def empty(cls, dim: int, *, device, dtype=torch.float64) -> LayerNormSystem:
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return cls(z(dim), z(dim), z(()), z(dim), z(dim))

    def add_task(self, moments: NormMoments, gamma: torch.Tensor, beta: torch.Tensor) -> None:
        dtype, device = self.energy.dtype, self.energy.device
        g, b = gamma.to(device=device, dtype=dtype), beta.to(device=device, dtype=dtype)
        e, m = moments.energy().to(dtype), moments.mean().to(dtype)
        self.energy += e
        self.mean += m
        self.count += 1
        self.rhs_gamma += e * g + m * b
        self.rhs_beta += m * g + b

    def solve(
        self, anchor_gamma: torch.Tensor, anchor_beta: torch.Tensor, *, lam: float, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, device = self.energy.dtype, self.energy.device
        a_g, a_b = anchor_gamma.to(device=device, dtype=dtype), anchor_beta.to(device=device, dtype=dtype)
        a11 = self.energy + lam
        a12 = self.mean
        a22 = self.count + lam
        r1 = self.rhs_gamma + lam * a_g
        r2 = self.rhs_beta + lam * a_b
        det = (a11 * a22 - a12 * a12).clamp_min(eps)
        return (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det


@dataclass
class ScaleNormSystem(Sums):
    """Per-dimension sums of the scale-only affine system of an RMSNorm (``γ·z``, no bias).

    Minimising Σ_t E_w[(γ z − γ_t z)²] + λ(γ − A(γ))² per dimension gives
    γ = (Σ_t e_t γ_t + λ A(γ)) / max(Σ_t e_t + λ, ε), with e_t = E_w[z²] of task t (not scaled by s_t,
    as the LayerNorm's statistics are not). ``γ`` is the effective scale: ``scale_offset + weight``.
    """

    energy: torch.Tensor
    rhs_gamma: torch.Tensor

    @classmethod
    def empty(cls, dim: int, *, device, dtype=torch.float64) -> ScaleNormSystem:
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return cls(z(dim), z(dim))

    def add_task(self, moments: NormMoments, gamma: torch.Tensor) -> None:
        dtype, device = self.energy.dtype, self.energy.device
        e = moments.energy().to(dtype)
        self.energy += e
        self.rhs_gamma += e * gamma.to(device=device, dtype=dtype)

    def solve(self, anchor_gamma: torch.Tensor, *, lam: float, eps: float) -> torch.Tensor:
        dtype, device = self.energy.dtype, self.energy.device
        a_g = anchor_gamma.to(device=device, dtype=dtype)
        return (self.rhs_gamma + lam * a_g) / (self.energy + lam).clamp_min(eps)
