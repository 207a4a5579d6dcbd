"""FeatCal statistics: weighted sums over tokens, additive across batches, tasks and processes.

Each class holds raw sums (never means), so two accumulators over disjoint data add exactly, and a
``torch.distributed`` all-reduce of the sums gives the statistics of the union.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., d] → [tokens, d], in float32 at least (bf16/fp16 models still get float32 sums)."""
    return x.reshape(-1, x.shape[-1]).to(torch.promote_types(x.dtype, torch.float32))


def _token_weights(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row weights for the flattened ``x`` (shape [..., seq, d]), or None for all ones."""
    if weights is None:
        return None
    w = weights.to(device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
    return w.expand(x.shape[:-1]).reshape(-1)


class _Sums:
    """Shared behaviour: element-wise addition, in-place all-reduce, device moves."""

    def __add__(self, other):
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def all_reduce(self) -> None:
        """Sum these statistics over all processes of the default ``torch.distributed`` group."""
        import torch.distributed as dist

        for f in fields(self):
            dist.all_reduce(getattr(self, f.name))


@dataclass
class LinearMoments(_Sums):
    """Sums for one linear submodule's input: Σw, Σw·x_s, Σw·x_e, Σw·x_s x_sᵀ, Σw·x_s x_eᵀ."""

    sum_w: torch.Tensor
    sum_xs: torch.Tensor
    sum_xe: torch.Tensor
    sum_ss: torch.Tensor
    sum_se: torch.Tensor

    @classmethod
    def zeros(cls, dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> LinearMoments:
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return cls(z(()), z(dim), z(dim), z(dim, dim), z(dim, dim))

    @torch.no_grad()
    def add(self, xs: torch.Tensor, xe: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Accumulate a batch of student and expert inputs ([..., d]) with per-position ``weights``."""
        acc = self.sum_ss.dtype
        s, e = _flat(xs), _flat(xe)
        w = _token_weights(xs, weights)
        if w is None:
            self.sum_w += s.shape[0]
            self.sum_xs += s.sum(0, dtype=acc)
            self.sum_xe += e.sum(0, dtype=acc)
            sw, ew = s, e
        else:
            self.sum_w += w.sum(dtype=acc)
            self.sum_xs += (w @ s).to(acc)
            self.sum_xe += (w @ e).to(acc)
            root = w.sqrt().unsqueeze(1)
            sw, ew = s * root, e * root
        self.sum_ss += (sw.T @ sw).to(acc)
        self.sum_se += (sw.T @ ew).to(acc)

    def mean_student(self) -> torch.Tensor:
        return self.sum_xs / self.sum_w

    def mean_teacher(self, alpha: float) -> torch.Tensor:
        return (alpha * self.sum_xe + (1 - alpha) * self.sum_xs) / self.sum_w

    def cov_student(self) -> torch.Tensor:
        """C_ss = E_w[x_s x_sᵀ]."""
        return self.sum_ss / self.sum_w

    def cross_teacher(self, alpha: float) -> torch.Tensor:
        """C_sτ = E_w[x_s x_τᵀ] with x_τ = α·x_e + (1−α)·x_s."""
        return (alpha * self.sum_se + (1 - alpha) * self.sum_ss) / self.sum_w


@dataclass
class LayerNormMoments(_Sums):
    """Sums for one LayerNorm's input: Σw, Σw·z, Σw·z² with z = LN(x_s) without affine."""

    sum_w: torch.Tensor
    sum_z: torch.Tensor
    sum_z2: torch.Tensor

    @classmethod
    def zeros(cls, dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> LayerNormMoments:
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return cls(z(()), z(dim), z(dim))

    @torch.no_grad()
    def add(self, xs: torch.Tensor, eps: float, weights: torch.Tensor | None = None) -> None:
        acc = self.sum_z.dtype
        x = _flat(xs)
        z = F.layer_norm(x, (x.shape[-1],), eps=eps)
        w = _token_weights(xs, weights)
        if w is None:
            self.sum_w += z.shape[0]
            self.sum_z += z.sum(0, dtype=acc)
            self.sum_z2 += z.square().sum(0, dtype=acc)
        else:
            self.sum_w += w.sum(dtype=acc)
            self.sum_z += (w @ z).to(acc)
            self.sum_z2 += (w @ z.square()).to(acc)

    def mean(self) -> torch.Tensor:
        return self.sum_z / self.sum_w

    def energy(self) -> torch.Tensor:
        return self.sum_z2 / self.sum_w
