"""LOT Merging's closed form for a normalisation layer, per dimension, on the experts' own features.

A normalisation maps its input x to y = s ⊙ z + β, with z = x̂ the input normalised without the affine
(``(x − mean) / std`` for a LayerNorm, ``x / rms(x)`` for an RMSNorm), s = o + w its scale (the module's
weight w, with offset o = 1 for Gemma's RMSNorm, else 0) and β its bias (none for an RMSNorm). With
z_t the normalised inputs expert t's own stream gives the layer over task t's calibration tokens (weights
a_n, 0 for padding), τ_t = w_t − w_0 and δ_t = β_t − β_0 the expert's task vectors, LOT minimises the
feature drift of the layer's output:

    Σ_t Σ_n a_n ‖z_t,n ⊙ (τ − τ_t) + (δ − δ_t)‖²,

which splits into one least-squares problem per dimension j (the offset o cancels). Its normal equations,
with S2_t = Σ_n a_n z_t,n,j², S1_t = Σ_n a_n z_t,n,j and N_t = Σ_n a_n, are

    [Σ S2_t  Σ S1_t] [τ_j]   [Σ_t S2_t τ_t,j + S1_t δ_t,j]
    [Σ S1_t  Σ N_t ] [δ_j] = [Σ_t S1_t τ_t,j + N_t δ_t,j ],

solved with the pseudo-inverse (the minimum-norm update: where a dimension's z is the same on every token
the scale and shift cannot be told apart, and the base's values are kept along what no token sets). A
norm without bias keeps the first row alone: τ_j = Σ_t S2_t τ_t,j / Σ_t S2_t, the task vectors averaged with
weights ‖z_t,·,j‖², which is how the paper's Eq. 12 reads as a published model card describes it
(``docs/repairs.md`` says which parts come from where). With a bias, the shift's row couples the two; where
every task's z has zero sum over its tokens in dimension j (S1_t = 0) the scale is that same weighted average
and the shift the token-weighted mean Σ_t N_t δ_t,j / Σ_t N_t.

The sums are float64: z is computed as the model computes it, then copied to float64 before it is squared.
"""

from __future__ import annotations

import torch
from torch import nn

from featcal.calibration.adapters import Normalization
from featcal.calibration.statistics import NormMoments
from featcal.distributed import SINGLE, World

DEGENERATE_RTOL = 1e-10
"""Eigenvalues of a dimension's 2×2 system below this fraction of its largest count as zero: a dimension
whose normalised input is (to float64 rounding) the same on every token, whose scale and shift only their
sum is set, gets the minimum-norm update instead of one that inverts rounding noise."""


class NormDrift:
    """One normalisation's drift system over the tasks, folded in task by task (see the module docstring).

    Args:
        norm: How the module normalises, and whether its affine has a bias.
        dim: The module's width.
        device: Where the sums live.
    """

    def __init__(self, norm: Normalization, dim: int, device: torch.device) -> None:
        self.norm = norm
        self.moments = NormMoments.zeros(dim, device=device)
        size = 2 if norm.has_bias else 1
        self.lhs = torch.zeros(dim, size, size, device=device, dtype=torch.float64)
        self.rhs = torch.zeros(dim, size, device=device, dtype=torch.float64)

    def add(self, x: torch.Tensor, token_weights: torch.Tensor | None) -> None:
        """Add one forward batch of the module's inputs to the task's sums.

        Args:
            x: The norm's inputs, ``[rows, seq, d]``.
            token_weights: Each token's weight, ``[rows, seq]`` (0 for padding); None: every token weighs 1.
        """
        self.moments.add(x, lambda rows: self.norm.normalize(rows).to(torch.float64, copy=True), token_weights)

    def fold(self, module: nn.Module, world: World = SINGLE) -> None:
        """End the task whose expert's parameters ``module`` holds: its sums (over every process) folded in
        with the expert's weight and bias.

        Args:
            module: The expert's norm (its ``weight`` and, for a LayerNorm, ``bias``).
            world: The processes whose sums are added together first.
        """
        moments = self.moments
        world.all_reduce_sum_(moments.tensors(), what="LOT normalisation statistics")
        lhs = _task_lhs(moments, self.norm.has_bias)
        params = [module.weight] + ([module.bias] if self.norm.has_bias else [])
        values = torch.stack([p.detach().to(self.rhs) for p in params], dim=1)  # [d, size]
        self.lhs += lhs
        self.rhs += (lhs @ values.unsqueeze(-1)).squeeze(-1)
        moments.zero_()

    @property
    def reached(self) -> bool:
        """Some token with a weight reached the module."""
        return bool(self.lhs[:, -1, -1].any()) if self.norm.has_bias else bool(self.lhs.any())

    def solved(self, anchor_weight: torch.Tensor, anchor_bias: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The module's weight (and bias) solved around the anchor's: w_0 + τ (and β_0 + δ), float64.

        Args:
            anchor_weight: w_0, the weight the task vectors are taken from (the base's).
            anchor_bias: β_0, for a module with bias (else unused).

        Returns:
            The solved weight, and bias when the module has one.
        """
        anchor = torch.stack([anchor_weight] + ([anchor_bias] if self.norm.has_bias else []), dim=1).to(self.rhs)
        residual = self.rhs - (self.lhs @ anchor.unsqueeze(-1)).squeeze(-1)  # Σ_t A_t (p_t − p_0)
        update = torch.linalg.pinv(self.lhs, rtol=DEGENERATE_RTOL, hermitian=True) @ residual.unsqueeze(-1)
        return list((anchor + update.squeeze(-1)).unbind(dim=1))


def _task_lhs(moments: NormMoments, has_bias: bool) -> torch.Tensor:
    """One task's per-dimension matrix ``[d, 2, 2]`` (``[[S2, S1], [S1, N]]``), or ``[d, 1, 1]`` (``S2``)."""
    s2 = moments.sum_z2.double()
    if not has_bias:
        return s2.view(-1, 1, 1)
    s1, count = moments.sum_z.double(), moments.sum_w.double().expand_as(s2)
    return torch.stack([torch.stack([s2, s1], -1), torch.stack([s1, count], -1)], -2)
