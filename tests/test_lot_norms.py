"""LOT Merging's normalisation closed form (:mod:`featcal.repairs.lot_norms`) against a float64 oracle that
minimises the drift objective directly, per dimension, by least squares."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from featcal.calibration.adapters import Normalization
from featcal.repairs.lot_norms import NormDrift

IDENTITY = lambda x: x  # noqa: E731 - the inputs given are the normalised features themselves


def drift_oracle(
    zs: list[torch.Tensor], weights: list[torch.Tensor], p0: torch.Tensor, ps: list[torch.Tensor], bias: bool
) -> torch.Tensor:
    """p_0 + the minimum-norm update u of min_u Σ_t Σ_n a_n (z_t,n,j u_j,0 + u_j,1 − z_t,n,j τ_t,j − δ_t,j)² for
    each dimension j (the scale alone without ``bias``), by LAPACK's gelsd on the tasks' token rows stacked;
    ``p`` is ``[d, 2]`` (scale, shift) or ``[d, 1]``."""
    solved = []
    for j in range(p0.shape[0]):
        rows, targets = [], []
        for z, a, p in zip(zs, weights, ps):
            root = a.sqrt()
            design = torch.stack([z[:, j], torch.ones_like(z[:, j])], dim=1)[:, : 2 if bias else 1]
            rows.append(design * root[:, None])
            targets.append(design @ (p[j] - p0[j]) * root)
        a, b = torch.cat(rows), torch.cat(targets)
        solved.append(p0[j] + torch.linalg.lstsq(a, b[:, None], driver="gelsd").solution[:, 0])
    return torch.stack(solved)


def closed_form(
    zs: list[torch.Tensor], weights: list[torch.Tensor], p0: torch.Tensor, ps: list[torch.Tensor], bias: bool
) -> torch.Tensor:
    """featcal's solve: each task's features folded in with its expert's (scale, shift), solved around p_0."""
    dim = p0.shape[0]
    drift = NormDrift(Normalization(IDENTITY, has_bias=bias), dim, torch.device("cpu"))
    module = nn.LayerNorm(dim, bias=bias, dtype=torch.float64)
    for z, a, p in zip(zs, weights, ps):
        drift.add(z.view(2, -1, dim), a.view(2, -1))  # [rows, seq, d], as a layer's hook records them
        with torch.no_grad():
            module.weight.copy_(p[:, 0])
            if bias:
                module.bias.copy_(p[:, 1])
        drift.fold(module)
    return torch.stack(drift.solved(p0[:, 0], p0[:, 1] if bias else None), dim=1)


def problem(seed: int, tokens: tuple[int, ...], dim: int = 7, degenerate: bool = False):
    """Each task's features (shifted from 0, so scale and shift couple), token weights (some 0: padding), the
    base's (scale, shift) and each expert's; with ``degenerate``, dimension 0's feature is one value on every
    token of every task (its scale and shift only set their sum)."""
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(n, dim, generator=g, dtype=torch.float64) * (1 + t) + 0.5 * t for t, n in enumerate(tokens)]
    if degenerate:
        for z in zs:
            z[:, 0] = 0.75
    weights = [(torch.rand(n, generator=g, dtype=torch.float64) > 0.2).double() * (1 + t) for t, n in enumerate(tokens)]
    p0 = torch.randn(dim, 2, generator=g, dtype=torch.float64)
    ps = [p0 + 0.1 * torch.randn(dim, 2, generator=g, dtype=torch.float64) for _ in tokens]
    return zs, weights, p0, ps


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("tokens", "degenerate"), [((40, 18, 26), False), ((6, 10, 4), True)])
def test_the_closed_form_minimises_the_drift_as_least_squares_does_in_float64(bias, tokens, degenerate) -> None:
    zs, weights, p0, ps = problem(sum(tokens) + bias, tokens, degenerate=degenerate)
    p0, ps = (p0, ps) if bias else (p0[:, :1], [p[:, :1] for p in ps])
    solved, want = closed_form(zs, weights, p0, ps, bias), drift_oracle(zs, weights, p0, ps, bias)
    assert torch.allclose(solved, want, rtol=0, atol=1e-10), float((solved - want).abs().max())
    if degenerate and bias:  # only the sum is set: the base's values move by equal amounts (minimum norm)
        update = solved[0] - p0[0]
        assert torch.allclose(update[0], update[1] * 0.75, atol=1e-10)


def test_without_bias_the_scale_is_the_task_vectors_weighted_by_their_features_squared_norms() -> None:
    """The model card's reading of the paper's Eq. 12: τ_j = Σ_t τ_t,j ‖z_t,·,j‖² / Σ_t ‖z_t,·,j‖²."""
    zs, _, p0, ps = problem(3, (12, 30))
    ones = [torch.ones(len(z), dtype=torch.float64) for z in zs]
    solved = closed_form(zs, ones, p0[:, :1], [p[:, :1] for p in ps], bias=False)[:, 0]
    norms = [z.square().sum(0) for z in zs]
    want = p0[:, 0] + sum(n * (p[:, 0] - p0[:, 0]) for n, p in zip(norms, ps)) / sum(norms)
    assert torch.allclose(solved, want, rtol=0, atol=1e-12)


def test_with_centred_features_the_shift_is_the_token_weighted_mean_of_the_shifts() -> None:
    """Where each task's features sum to 0 over its tokens in every dimension, scale and shift decouple: the
    scale is the squared-norm-weighted average, the shift the tokens' mean of the experts' shifts."""
    zs, _, p0, ps = problem(5, (10, 30, 16))
    zs = [z - z.mean(0) for z in zs]
    ones = [torch.ones(len(z), dtype=torch.float64) for z in zs]
    solved = closed_form(zs, ones, p0, ps, bias=True)
    norms = [z.square().sum(0) for z in zs]
    scale = p0[:, 0] + sum(n * (p[:, 0] - p0[:, 0]) for n, p in zip(norms, ps)) / sum(norms)
    shift = sum(len(z) * p[:, 1] for z, p in zip(zs, ps)) / sum(len(z) for z in zs)
    assert torch.allclose(solved[:, 0], scale, atol=1e-12) and torch.allclose(solved[:, 1], shift, atol=1e-12)


def test_a_layernorm_s_drift_is_minimised_on_the_features_it_normalises() -> None:
    """Through the module's own normalisation: no (scale, shift) near the solution gives the experts' layer
    outputs a smaller summed squared drift."""
    g = torch.Generator().manual_seed(11)
    dim = 6
    xs = [torch.randn(2, 9, dim, generator=g, dtype=torch.float64) * 4 + 3 for _ in range(3)]
    experts = [nn.LayerNorm(dim, dtype=torch.float64) for _ in xs]
    for module in experts:
        nn.init.normal_(module.weight, 1.0, 0.2, generator=g)
        nn.init.normal_(module.bias, 0.0, 0.2, generator=g)
    layer_norm = Normalization(lambda x: F.layer_norm(x, (dim,), eps=1e-5), has_bias=True)
    drift = NormDrift(layer_norm, dim, torch.device("cpu"))
    for x, module in zip(xs, experts):
        drift.add(x, None)
        drift.fold(module)
    weight, bias = drift.solved(torch.ones(dim, dtype=torch.float64), torch.zeros(dim, dtype=torch.float64))

    def loss(w: torch.Tensor, b: torch.Tensor) -> float:
        with torch.no_grad():
            return sum(float((F.layer_norm(x, (dim,), w, b) - m(x)).square().sum()) for x, m in zip(xs, experts))

    best = loss(weight, bias)
    for _ in range(20):
        dw, db = (1e-3 * torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(2))
        assert loss(weight + dw, bias + db) > best
    assert best < loss(sum(m.weight for m in experts) / 3, sum(m.bias for m in experts) / 3)  # beats the mean


def test_a_single_task_gives_back_its_expert_s_scale_and_shift() -> None:
    zs, weights, p0, ps = problem(9, (24,))
    solved = closed_form(zs, weights, p0, ps, bias=True)
    assert torch.allclose(solved, ps[0], rtol=0, atol=1e-12)


def test_a_module_no_token_reached_is_not_reached() -> None:
    drift = NormDrift(Normalization(IDENTITY, has_bias=True), 4, torch.device("cpu"))
    drift.add(torch.randn(1, 3, 4, dtype=torch.float64), torch.zeros(1, 3))
    drift.fold(nn.LayerNorm(4, dtype=torch.float64))
    assert not drift.reached
