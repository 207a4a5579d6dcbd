"""RegMean's closed form for the linears that read one input: W* = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ, transposed.

G_t is the mean of x xᵀ over task t's tokens (:meth:`~featcal.calibration.statistics.SecondMoments.mean`),
and G̃_t is G_t with its off-diagonal entries multiplied by ``reduce_non_diagonal_ratio`` (its diagonal
kept), as FusionBench's ``reduce_non_diagonal_elements`` does. Tasks are folded in one at a time, so
memory does not grow with their number; the sums and the solve are in float64.

FusionBench builds the mask of factors in float32 whatever the Gram's dtype: r becomes float32(r), and
the diagonal's factor is float32(1 − r) + r summed in float32 (1 − 6e-8 for r = 0.95, not 1). Those
factors are kept, so that float64 merges agree with FusionBench's float64 ones to 1e-12, not 1e-9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featcal.calibration.solves import solve_general
from featcal.calibration.statistics import Sums


def reduce_non_diagonal(gram: torch.Tensor, ratio: float) -> torch.Tensor:
    """``gram`` with every entry off its diagonal multiplied by ``ratio``, its diagonal by 1, each factor
    rounded as FusionBench's float32 mask rounds it (a new tensor)."""
    off = torch.tensor(ratio, dtype=torch.float32, device=gram.device)
    on = (torch.tensor(1.0, dtype=torch.float32, device=gram.device) - off) + off
    reduced = gram * off.to(gram.dtype)
    reduced.diagonal().copy_(gram.diagonal() * on.to(gram.dtype))
    return reduced


@dataclass
class RegMeanSystem(Sums):
    """Σ_t G̃_t (``lhs``, d_in × d_in) and Σ_t G̃_t W_tᵀ (``rhs``, d_in × d_out) for linears reading one input,
    their weights stacked along the outputs (q, k and v together)."""

    lhs: torch.Tensor
    rhs: torch.Tensor

    @classmethod
    def empty(cls, in_features: int, out_features: int, *, device: torch.device | str) -> RegMeanSystem:
        """A system with no task folded in yet, in float64."""
        zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=torch.float64)  # noqa: E731
        return cls(zeros(in_features, in_features), zeros(in_features, out_features))

    def add_task(self, gram: torch.Tensor, weight: torch.Tensor, ratio: float) -> None:
        """Fold in one task: its Gram G_t (d_in × d_in) and its experts' weights W_t (d_out × d_in).

        Args:
            gram: G_t, the mean of x xᵀ over the task's tokens.
            weight: W_t, the task's expert weights of the linears, stacked along the outputs.
            ratio: ``reduce_non_diagonal_ratio``, the factor of G_t's off-diagonal entries.
        """
        reduced = reduce_non_diagonal(gram.to(self.lhs.dtype), ratio)
        self.lhs += reduced
        self.rhs.addmm_(reduced, weight.to(device=self.rhs.device, dtype=self.rhs.dtype).T)

    def solve(self) -> torch.Tensor:
        """W* (d_out × d_in, float64): lhs⁻¹·rhs transposed (by the pseudo-inverse when lhs is singular)."""
        return solve_general(self.lhs, self.rhs).T

    def solve_update(self, anchor: torch.Tensor) -> torch.Tensor:
        """LOT Merging's solution around ``anchor`` W_0 (d_out × d_in): W_0 + (G⁺ Σ_t G_t (W_t − W_0)ᵀ)ᵀ with
        G = lhs and G⁺ its Moore–Penrose pseudo-inverse, which leaves W_0 where no task's input reaches
        (float64, d_out × d_in).

        Args:
            anchor: W_0, the weights the updates are taken from (the base's), stacked as the system's.

        Returns:
            The solved weight, float64.
        """
        w0 = anchor.to(self.lhs)
        update = torch.linalg.pinv(self.lhs, hermitian=True) @ (self.rhs - self.lhs @ w0.T)
        return w0 + update.T
