"""FeatCal statistics and closed-form solves against analytic cases."""

import pytest
import torch

from featcal.calibration.solves import LayerNormSystem, LinearSystem, ScaleNormSystem, anchor
from featcal.calibration.statistics import LinearMoments, NormMoments

torch.manual_seed(0)


def moments(xs, xe, w=None):
    m = LinearMoments.zeros(xs.shape[-1])
    m.add(xs, xe, w)
    return m


def solve_linear(tasks, merged_w, base_w, merged_b, base_b, lam, rho=2.2, alpha=0.25, eps=1e-8):
    out, inp = merged_w.shape
    system = LinearSystem.empty(out, inp, merged_b is not None, device="cpu")
    for m, w, b in tasks:
        system.add_task(m, w, b, alpha=alpha, eps=eps)
    a_b = anchor(merged_b.double(), base_b.double(), rho) if merged_b is not None else None
    return system.solve(anchor(merged_w.double(), base_w.double(), rho), a_b, lam=lam, eps=eps)


def test_one_task_expert_equals_merged_lambda_zero_returns_expert():
    xs = torch.randn(4, 50, 8)
    w_t, b_t = torch.randn(5, 8), torch.randn(5)
    # expert stream equal to student stream: the teacher input is x_s itself
    weight, bias = solve_linear(
        [(moments(xs, xs), w_t, b_t)], w_t, torch.zeros(5, 8), b_t, torch.zeros(5), lam=0.0, eps=0.0
    )
    torch.testing.assert_close(weight.float(), w_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias.float(), b_t, atol=1e-5, rtol=1e-5)


def test_huge_lambda_returns_anchor():
    xs, xe = torch.randn(2, 30, 6), torch.randn(2, 30, 6)
    w_m, w_0, w_t = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    b_m, b_0, b_t = torch.randn(4), torch.randn(4), torch.randn(4)
    weight, bias = solve_linear([(moments(xs, xe), w_t, b_t)], w_m, w_0, b_m, b_0, lam=1e9)
    torch.testing.assert_close(weight.float(), 2.2 * w_m - 1.2 * w_0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias.float(), 2.2 * b_m - 1.2 * b_0, atol=1e-5, rtol=1e-5)


def test_weight_matches_lstsq_on_stacked_tasks():
    """Σ_t s_t E‖W x_s − W_t x_τ‖² + λ‖W − A‖² equals one stacked least-squares problem."""
    lam, alpha, rho = 0.3, 0.4, 1.5
    d_in, d_out = 7, 3
    w_m, w_0 = torch.randn(d_out, d_in, dtype=torch.float64), torch.randn(d_out, d_in, dtype=torch.float64)
    tasks, rows, targets = [], [], []
    for _ in range(3):
        xs, xe = torch.randn(40, d_in, dtype=torch.float64), torch.randn(40, d_in, dtype=torch.float64)
        w_t = torch.randn(d_out, d_in, dtype=torch.float64)
        m = moments(xs, xe)
        s = 1.0 / m.cov_student().norm()
        xt = alpha * xe + (1 - alpha) * xs
        # E over 40 tokens: weight each row by sqrt(s / 40)
        rows.append(xs * (s / 40).sqrt())
        targets.append((xt @ w_t.T) * (s / 40).sqrt())
        tasks.append((m, w_t, None))
    a = rho * w_m + (1 - rho) * w_0
    rows.append(lam**0.5 * torch.eye(d_in, dtype=torch.float64))
    targets.append(lam**0.5 * a.T)
    expected = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    weight, bias = solve_linear(tasks, w_m, w_0, None, None, lam=lam, rho=rho, alpha=alpha, eps=0.0)
    assert bias is None
    torch.testing.assert_close(weight, expected, atol=1e-9, rtol=1e-9)


def layer_norm(dim: int, eps: float):
    """A LayerNorm's normalisation without its affine, as an adapter describes it."""
    return lambda x: torch.nn.functional.layer_norm(x, (dim,), eps=eps)


def rms_norm(eps: float):
    """An RMSNorm's normalisation without its scale: x / sqrt(mean(x²) + eps)."""
    return lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_scale_norm_solve_matches_least_squares_per_dimension(offset):
    """An RMSNorm's scale (γ = offset + w, Gemma's form with offset 1) against a per-dimension least-squares
    oracle in float64, token weights (padding at 0) included."""
    dim, lam, rho = 5, 0.2, 2.2
    w_m, w_0 = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    system = ScaleNormSystem.empty(dim, device="cpu")
    rows, targets = [], []
    for _ in range(3):
        x = torch.randn(4, 7, dim, dtype=torch.float64) * 2 + 0.5
        weights = (torch.rand(4, 7, dtype=torch.float64) > 0.3).double()  # some tokens are padding
        m = NormMoments.zeros(dim)
        m.add(x, rms_norm(1e-6), weights)
        w_t = torch.randn(dim, dtype=torch.float64)
        system.add_task(m, w_t + offset)
        z = rms_norm(1e-6)(x).reshape(-1, dim)
        root = (weights.reshape(-1, 1) / weights.sum()).sqrt()
        rows.append(z * root)
        targets.append(z * root * (w_t + offset))
    a_w = anchor(w_m, w_0, rho)
    weight = system.solve(a_w + offset, lam=lam, eps=0.0) - offset
    for j in range(dim):  # min Σ_t E_w[(γ z − γ_t z)²] + λ (γ − A(γ))², with γ = offset + w
        a = torch.cat([*(r[:, j : j + 1] for r in rows), lam**0.5 * torch.ones(1, 1, dtype=torch.float64)])
        y = torch.cat([*(t[:, j] for t in targets), lam**0.5 * (a_w[j : j + 1] + offset)])
        gamma = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze()
        torch.testing.assert_close(weight[j], gamma - offset, atol=1e-9, rtol=1e-9)


def test_layernorm_solve_matches_least_squares_per_dimension():
    dim, lam, rho = 5, 0.2, 2.0
    g_m, g_0, b_m, b_0 = (torch.randn(dim, dtype=torch.float64) for _ in range(4))
    system = LayerNormSystem.empty(dim, device="cpu")
    zs, gammas, betas = [], [], []
    for _ in range(2):
        x = torch.randn(3, 20, dim, dtype=torch.float64) * 3 + 1
        m = NormMoments.zeros(dim)
        m.add(x, layer_norm(dim, 1e-5))
        g_t, b_t = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
        system.add_task(m, g_t, b_t)
        zs.append(torch.nn.functional.layer_norm(x, (dim,), eps=1e-5).reshape(-1, dim))
        gammas.append(g_t)
        betas.append(b_t)
    gamma, beta = system.solve(anchor(g_m, g_0, rho), anchor(b_m, b_0, rho), lam=lam, eps=0.0)
    for j in range(dim):  # per dimension: 2-parameter least squares, rows scaled by 1/sqrt(N)
        a_rows, y = [], []
        for z, g_t, b_t in zip(zs, gammas, betas):
            n = z.shape[0]
            a_rows.append(torch.stack([z[:, j], torch.ones(n, dtype=torch.float64)], 1) / n**0.5)
            y.append((g_t[j] * z[:, j] + b_t[j]) / n**0.5)
        a_rows.append(lam**0.5 * torch.eye(2, dtype=torch.float64))
        y.append(lam**0.5 * torch.stack([rho * g_m[j] + (1 - rho) * g_0[j], rho * b_m[j] + (1 - rho) * b_0[j]]))
        sol = torch.linalg.lstsq(torch.cat(a_rows), torch.cat(y)).solution
        torch.testing.assert_close(torch.stack([gamma[j], beta[j]]), sol, atol=1e-9, rtol=1e-9)


def test_statistics_are_additive_across_batches():
    xs, xe = torch.randn(6, 9, 4), torch.randn(6, 9, 4)
    w = torch.rand(9) + 0.01
    whole = moments(xs, xe, w)
    parts = moments(xs[:2], xe[:2], w) + moments(xs[2:5], xe[2:5], w) + moments(xs[5:], xe[5:], w)
    for name in ("sum_w", "sum_xs", "sum_xe", "sum_ss", "sum_se"):
        torch.testing.assert_close(getattr(parts, name), getattr(whole, name), rtol=1e-6, atol=1e-5)
    ln_whole = NormMoments.zeros(4)
    ln_whole.add(xs, layer_norm(4, 1e-5), w)
    ln_parts = NormMoments.zeros(4)
    for chunk in (slice(0, 1), slice(1, 6)):
        ln_parts.add(xs[chunk], layer_norm(4, 1e-5), w)
    torch.testing.assert_close(ln_parts.sum_z2, ln_whole.sum_z2, rtol=1e-6, atol=1e-5)


def test_weighted_moments_match_definition():
    xs, xe = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    w = torch.tensor([1.0, 0.01, 0.01, 0.01, 0.01])
    m = moments(xs, xe, w)
    ww = w.expand(3, 5).reshape(-1, 1).double()
    fs, fe = xs.reshape(-1, 4), xe.reshape(-1, 4)
    torch.testing.assert_close(m.cov_student(), (fs * ww).T @ fs / ww.sum(), atol=1e-6, rtol=1e-6)
    tau = 0.25 * fe + 0.75 * fs
    torch.testing.assert_close(m.cross_teacher(0.25), (fs * ww).T @ tau / ww.sum(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m.mean_teacher(0.25), (tau * ww).sum(0) / ww.sum(), atol=1e-6, rtol=1e-6)
