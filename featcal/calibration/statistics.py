"""FeatCal statistics: weighted sums over tokens, additive across batches, tasks and processes.

Each moments class holds raw sums (never means), so two accumulators over disjoint data add exactly,
and a sum of the sums over processes gives the statistics of the union. FeatCal's are crossed
student/expert sums; :class:`SecondMoments` are one stream's alone (the Gram Σ x xᵀ RegMean merges by).

The products behind the sums run in float32 (or the inputs' dtype when wider) on large row chunks
through :class:`GramAccumulator`, which computes only the upper block triangle of the symmetric
x_sᵀx_s and flushes into the moments' own dtype (float64 by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from featcal.calibration.workspace import Workspace


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of statistics products for inputs of ``dtype``: float32 at least."""
    return torch.promote_types(dtype, torch.float32)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., d] → [tokens, d], in float32 at least (bf16/fp16 models still get float32 sums)."""
    return x.reshape(-1, x.shape[-1]).to(product_dtype(x.dtype))


def _token_weights(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row weights for the flattened ``x`` (shape [..., seq, d]), or None for all ones."""
    if weights is None:
        return None
    w = weights.to(device=x.device, dtype=product_dtype(x.dtype))
    return w.expand(x.shape[:-1]).reshape(-1)


def _add_cast(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target += source`` across dtypes. A mixed-dtype in-place add is several times slower on CPU
    than a cast copy followed by a same-dtype add, so cast first."""
    target += source if source.dtype == target.dtype else source.to(target.dtype)


class Sums:
    """Dataclass fields that are tensors of sums: element-wise addition and an in-place reset.

    Shared by the moments here and the normal-equation systems of :mod:`featcal.calibration.solves`;
    fields that are None (a linear without bias) are skipped.
    """

    def __add__(self, other):
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        """The sums, in field order (fields that are None left out): what processes add together."""
        return [value for f in fields(self) if (value := getattr(self, f.name)) is not None]

    def zero_(self) -> None:
        """Reset every sum to zero, in place (to reuse the memory for another layer)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value.zero_()


def _zeros(device, dtype, *shapes):
    return [torch.zeros(shape, device=device, dtype=dtype) for shape in shapes]


@dataclass
class LinearMoments(Sums):
    """Sums for one linear submodule's input: Σw, Σw·x_s, Σw·x_e, Σw·x_s x_sᵀ, Σw·x_s x_eᵀ."""

    sum_w: torch.Tensor
    sum_xs: torch.Tensor
    sum_xe: torch.Tensor
    sum_ss: torch.Tensor
    sum_se: torch.Tensor

    @classmethod
    def zeros(
        cls, dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64
    ) -> LinearMoments:
        return cls(*_zeros(device, dtype, (), dim, dim, (dim, dim), (dim, dim)))

    @torch.no_grad()
    def add(self, xs: torch.Tensor, xe: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Accumulate a batch of student and expert inputs ([..., d]) with per-position ``weights``."""
        _add_pair(self, xs, xe, weights)

    def mean_student(self) -> torch.Tensor:
        return self.sum_xs / self.sum_w

    def mean_teacher(self, alpha: float) -> torch.Tensor:
        return (alpha * self.sum_xe + (1 - alpha) * self.sum_xs) / self.sum_w

    def cov_student(self) -> torch.Tensor:
        """C_ss = E_w[x_s x_sᵀ]."""
        return self.sum_ss / self.sum_w

    def cross_teacher(self, alpha: float) -> torch.Tensor:
        """C_sτ = E_w[x_s x_τᵀ] with x_τ = α·x_e + (1−α)·x_s."""
        cross = self.sum_ss * ((1 - alpha) / self.sum_w)
        return cross.addcmul_(self.sum_se, alpha / self.sum_w)

    def teacher_rhs(self, alpha: float, weight: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """W_t·C_τs = (C_sτ·W_tᵀ)ᵀ ([d_out, d_in], the weight's layout) for the expert weight W_t, as a product
        in W_t's dtype (float32 at least). ``workspace`` is unused: here d_in is the narrow side (768 at
        ViT-B/32), so C_sτ stays small."""
        dtype = product_dtype(weight.dtype)
        return (weight.to(dtype) @ self.cross_teacher(alpha).to(dtype).T).to(self.sum_ss.dtype)

    def teacher_output_mean(self, alpha: float, weight: torch.Tensor) -> torch.Tensor:
        """W_t·μ_τ."""
        return weight.to(self.sum_xs.dtype) @ self.mean_teacher(alpha)


@dataclass
class ProjectedLinearMoments(Sums):
    """Sums for a linear whose expert outputs y_e = W_t·x_e (bias left out) are narrower than its
    inputs: Σw, Σw·x_s, Σw·y_e, Σw·x_s x_sᵀ, Σw·x_s y_eᵀ.

    Since C_sτ·W_tᵀ = α·E_w[x_s y_eᵀ] + (1−α)·C_ss·W_tᵀ, the expert's inputs are never needed, and
    the cross product costs d_in·d_out instead of d_in² per token (fc2 of a ViT: 4× less).
    """

    sum_w: torch.Tensor
    sum_xs: torch.Tensor
    sum_ye: torch.Tensor
    sum_ss: torch.Tensor
    sum_sy: torch.Tensor

    @classmethod
    def zeros(
        cls, dim: int, out_dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64
    ) -> ProjectedLinearMoments:
        return cls(*_zeros(device, dtype, (), dim, out_dim, (dim, dim), (dim, out_dim)))

    @torch.no_grad()
    def add(self, xs: torch.Tensor, ye: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Accumulate student inputs ([..., d_in]) and expert outputs without bias ([..., d_out])."""
        _add_pair(self, xs, ye, weights)

    def mean_student(self) -> torch.Tensor:
        return self.sum_xs / self.sum_w

    def cov_student(self) -> torch.Tensor:
        return self.sum_ss / self.sum_w

    def teacher_rhs(self, alpha: float, weight: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """W_t·C_τs = (α·E_w[x_s y_eᵀ] + (1−α)·C_ss·W_tᵀ)ᵀ ([d_out, d_in], the weight's layout); the product in
        W_t's dtype (float32 at least), its cast of C_ss in a ``workspace`` buffer when one is given."""
        dtype = product_dtype(weight.dtype)
        gram = self.sum_ss
        if dtype != gram.dtype:
            gram = (
                gram.to(dtype)
                if workspace is None
                else workspace.get("gram", gram.shape, dtype, gram.device).copy_(gram)
            )
        projected = (weight.to(dtype) @ gram.T).to(self.sum_ss.dtype)
        return projected.mul_((1 - alpha) / self.sum_w).addcmul_(self.sum_sy.T, alpha / self.sum_w)

    def teacher_output_mean(self, alpha: float, weight: torch.Tensor) -> torch.Tensor:
        return (alpha * self.sum_ye + (1 - alpha) * (weight.to(self.sum_xs.dtype) @ self.sum_xs)) / self.sum_w


@dataclass
class SecondMoments(Sums):
    """Sums for one linear submodule's input on a single stream: Σw and Σw·x xᵀ, accumulated by a
    :class:`GramAccumulator` without cross columns.

    With every token weighing 1 (w = 1) :meth:`mean` is the mean of x xᵀ over the tokens: the Gram
    matrix RegMean merges a linear by (:mod:`featcal.merging.regmean`).
    """

    sum_w: torch.Tensor
    sum_xx: torch.Tensor

    @classmethod
    def zeros(
        cls, dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64
    ) -> SecondMoments:
        return cls(*_zeros(device, dtype, (), (dim, dim)))

    def mean(self) -> torch.Tensor:
        """E_w[x xᵀ]: the sums of squares and products over the total weight."""
        return self.sum_xx / self.sum_w


PairMoments = LinearMoments | ProjectedLinearMoments
Moments = PairMoments | SecondMoments


def _add_pair(moments: PairMoments, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor | None) -> None:
    """One batch into ``moments`` through a :class:`GramAccumulator` (the simple, unbuffered path)."""
    fa, fb = _flat(a), _flat(b).to(product_dtype(a.dtype))
    joint = torch.cat([fa, fb], dim=1)
    w = _token_weights(a, weights)
    if w is not None:
        joint.mul_(w.to(joint.dtype).sqrt().unsqueeze(1))
    gram = GramAccumulator(
        fa.shape[1], fb.shape[1], device=joint.device, dtype=joint.dtype, sum_dtype=moments.sum_xs.dtype
    )
    gram.add(
        joint,
        None if w is None else w.to(joint.dtype).sqrt(),
        fa.shape[0] if w is None else w.sum(),
        group=a.shape[-2] if a.dim() > 2 else 1,
    )
    gram.flush(moments)


def column_sums(x: torch.Tensor, weights: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Σ_rows w·x of a [rows, d] tensor, in ``dtype``: ``group`` consecutive rows (one sequence) are
    summed in x's dtype, the partial sums in ``dtype``. Means enter FeatCal's bias solve as differences
    of large numbers, and a float32 sum over thousands of rows visibly moves the calibrated biases;
    a float64 reduction of every element would cost a tenth of the products on CPU."""
    rows, width = x.shape
    group = group if rows % group == 0 else 1
    parts = x.view(rows // group, group, width)
    if weights is None:
        partial = parts.sum(1)
    else:
        partial = torch.matmul(weights.to(x.dtype).view(rows // group, 1, group), parts).squeeze(1)
    return partial.sum(0, dtype=dtype)


def triangle_blocks(dim: int) -> list[tuple[int, int]]:
    """Row blocks for the upper block triangle of a dim×dim Gram matrix: wide enough that each
    product stays efficient, narrow enough to skip a good part of the lower triangle."""
    count = max(1, min(8, dim // 384))
    size = -(-dim // count)
    return [(start, min(start + size, dim)) for start in range(0, dim, size)]


class GramAccumulator:
    """Σ aᵀ·[a | b] over row chunks of a joint buffer ``[a | b]`` ([rows, d_a + d_b]), plus its column sums.

    Only the upper block triangle of the symmetric aᵀa is computed, fused with aᵀb into one matmul per
    row block (``addmm_`` into preallocated accumulators, no temporaries). Rows must already carry the
    square root of their token weight. :meth:`flush` moves everything into a moments object (mirroring
    the triangle) and restarts, so float32 products reach float64 sums every few chunks. A restarted
    accumulator is overwritten by its next product, never zeroed.
    """

    def __init__(
        self,
        dim: int,
        cross: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        sum_dtype: torch.dtype = torch.float64,
    ) -> None:
        self.dim, self.cross = dim, cross
        self.blocks = triangle_blocks(dim)
        self.acc = [
            torch.empty(stop - start, dim + cross - start, device=device, dtype=dtype) for start, stop in self.blocks
        ]
        self.col_sums = torch.empty(dim + cross, device=device, dtype=sum_dtype)
        self.weight_sum: torch.Tensor | float = 0.0
        self.rows = 0

    @torch.no_grad()
    def add(
        self, joint: torch.Tensor, root: torch.Tensor | None, weight_sum: torch.Tensor | float, group: int = 1
    ) -> None:
        """Accumulate ``joint`` ([rows, d_a + d_b], rows scaled by ``root`` = √w, or unweighted when None).

        ``group``: rows per sequence, for :func:`column_sums`.
        """
        beta = 0 if self.rows == 0 else 1
        for (start, stop), acc in zip(self.blocks, self.acc):
            acc.addmm_(joint[:, start:stop].T, joint[:, start:], beta=beta)
        sums = column_sums(joint, root, group, self.col_sums.dtype)  # Σ √w·(√w·x) = Σ w·x
        if self.rows == 0:
            self.col_sums.copy_(sums)
        else:
            self.col_sums += sums
        self.weight_sum = self.weight_sum + weight_sum
        self.rows += joint.shape[0]

    @torch.no_grad()
    def flush(self, moments: Moments, scratch: torch.Tensor | None = None, *, overwrite: bool = False) -> None:
        """Add the accumulated sums into ``moments`` (or, with ``overwrite``, replace them) and restart.
        ``moments``: crossed sums for an accumulator with ``cross`` columns, :class:`SecondMoments` for
        one without. ``scratch``: a [max block, d_a + d_b] buffer in the moments' dtype, reused for the casts."""
        total_w, sum_a, sum_b, gram, cross = _flush_targets(moments)
        if self.rows == 0:
            if overwrite:
                moments.zero_()
            return
        dim = self.dim
        for (start, stop), acc in zip(self.blocks, self.acc):
            if not overwrite:
                if scratch is None or acc.dtype == gram.dtype:
                    acc = acc.to(gram.dtype)
                else:
                    acc = scratch[: acc.shape[0], : acc.shape[1]].copy_(acc)
            parts = [acc[:, : dim - start], acc[:, stop - start : dim - start].T]
            targets = [gram[start:stop, start:], gram[stop:, start:stop]]
            if cross is not None:
                parts.append(acc[:, dim - start :])
                targets.append(cross[start:stop])
            for target, part in zip(targets, parts):
                if overwrite:  # one cast copy per element: the usual case, a task in one flush
                    target.copy_(part)
                else:
                    target += part
        for target, sums in ((sum_a, self.col_sums[:dim]), (sum_b, self.col_sums[dim:])):
            if target is None:
                continue
            if overwrite:
                target.copy_(sums)
            else:
                _add_cast(target, sums)
        if overwrite:
            total_w.zero_()
        total_w += self.weight_sum
        self.weight_sum, self.rows = 0.0, 0


def _flush_targets(moments: Moments) -> tuple[torch.Tensor, ...]:
    """Where a flush adds: Σw, the column sums of a and of b, aᵀa and aᵀb (for :class:`SecondMoments`
    Σw and aᵀa alone, the others None)."""
    if isinstance(moments, SecondMoments):
        return moments.sum_w, None, None, moments.sum_xx, None
    return tuple(getattr(moments, f.name) for f in fields(moments))


@dataclass
class NormMoments(Sums):
    """Sums for one normalisation's input: Σw, Σw·z, Σw·z² with z its input normalised without the
    affine (``LN(x_s)`` for a LayerNorm, ``x_s / rms(x_s)`` for an RMSNorm)."""

    sum_w: torch.Tensor
    sum_z: torch.Tensor
    sum_z2: torch.Tensor

    @classmethod
    def zeros(cls, dim: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> NormMoments:
        return cls(*_zeros(device, dtype, (), dim, dim))

    @torch.no_grad()
    def add(
        self,
        xs: torch.Tensor,
        normalize: Callable[[torch.Tensor], torch.Tensor],
        weights: torch.Tensor | None = None,
    ) -> None:
        """Accumulate student inputs ``xs`` ([..., d]) normalised by ``normalize``, with per-token ``weights``
        (per position, or per row and position)."""
        x = _flat(xs)
        z = normalize(x)
        w = _token_weights(xs, weights)
        group = xs.shape[-2] if xs.dim() > 2 else 1
        self.sum_w += z.shape[0] if w is None else w.sum()
        self.sum_z += column_sums(z, w, group, self.sum_z.dtype)
        self.sum_z2 += column_sums(z.square_(), w, group, self.sum_z2.dtype)

    def mean(self) -> torch.Tensor:
        return self.sum_z / self.sum_w

    def energy(self) -> torch.Tensor:
        return self.sum_z2 / self.sum_w
