"""The engine's fast paths give the same numbers as the plain definitions: the block-triangle Gram
accumulator, statistics crossed with the expert's outputs (fc2), chunked statistics with periodic
float64 flushes, the shared q/k/v solve, the Cholesky solve and its fallbacks."""

import pytest
import torch
from transformers import CLIPVisionModel

import featcal.calibration.driver as driver
import featcal.calibration.layer_state as layer_state
from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.calibration.solves import LinearSystem, solve_general
from featcal.calibration.statistics import (
    GramAccumulator,
    LinearMoments,
    ProjectedLinearMoments,
    SecondMoments,
    column_sums,
    triangle_blocks,
)
from featcal.calibration.workspace import Workspace
from featcal.families.clip_vision.folders import vision_checkpoint
from tests.support.builders import FIXTURE

torch.manual_seed(0)


@pytest.mark.parametrize("dim", [5, 768, 1000])
def test_triangle_blocks_cover_the_rows(dim):
    blocks = triangle_blocks(dim)
    assert blocks[0][0] == 0 and blocks[-1][1] == dim
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert (len(blocks) > 1) == (dim >= 768)


def test_gram_accumulator_equals_full_products_with_weights_and_flushes(device):
    dim, cross, seq = 800, 96, 10  # 800: two row blocks, so the mirrored lower triangle is exercised
    f64 = dict(dtype=torch.float64, device=device)
    a, b = torch.randn(60, dim, **f64), torch.randn(60, cross, **f64)
    w = torch.rand(seq, **f64).repeat(6)
    root = w.sqrt()
    joint = torch.cat([a, b], 1) * root[:, None]
    moments = ProjectedLinearMoments.zeros(dim, cross, device=device)
    gram = GramAccumulator(dim, cross, device=device, dtype=torch.float64)
    for rows in (slice(0, 20), slice(20, 60)):  # two chunks, a flush after each
        gram.add(joint[rows], root[rows], float(w[rows].sum()), group=seq)
        gram.flush(moments)
    torch.testing.assert_close(moments.sum_ss, (a * w[:, None]).T @ a)
    torch.testing.assert_close(moments.sum_sy, (a * w[:, None]).T @ b)
    torch.testing.assert_close(moments.sum_xs, w @ a)
    torch.testing.assert_close(moments.sum_ye, w @ b)
    torch.testing.assert_close(moments.sum_w, w.sum())
    # a flushed accumulator restarts from nothing; overwrite replaces the moments
    gram.add(joint[:10], root[:10], float(w[:10].sum()), group=seq)
    gram.flush(moments, overwrite=True)
    torch.testing.assert_close(moments.sum_ss, (a[:10] * w[:10, None]).T @ a[:10])
    torch.testing.assert_close(moments.sum_ye, w[:10] @ b[:10])
    torch.testing.assert_close(moments.sum_w, w[:10].sum())


def test_second_moments_are_one_streams_gram_through_the_accumulator(device):
    """RegMean's Σw·x xᵀ: the accumulator without cross columns, float32 products flushed into float64
    sums chunk by chunk, mirrors the block triangle into the full Gram."""
    dim, seq = 800, 10
    x = torch.randn(60, dim, device=device)
    w = torch.rand(60, device=device)
    root = w.sqrt()
    moments = SecondMoments.zeros(dim, device=device)
    gram = GramAccumulator(dim, 0, device=device)
    for rows in (slice(0, 20), slice(20, 60)):
        gram.add(x[rows] * root[rows, None], root[rows], w[rows].sum(), group=seq)
        gram.flush(moments)
    expected = (x.double() * w.double()[:, None]).T @ x.double()
    assert moments.sum_xx.dtype == torch.float64 and [t.shape for t in moments.tensors()] == [(), (dim, dim)]
    torch.testing.assert_close(moments.sum_xx, expected, rtol=1e-5, atol=1e-4)  # float32 products
    torch.testing.assert_close(moments.mean(), expected / w.double().sum(), rtol=1e-5, atol=1e-6)
    gram.add(x[:10], None, 10, group=seq)
    gram.flush(moments, overwrite=True)
    torch.testing.assert_close(moments.sum_xx, x[:10].double().T @ x[:10].double(), rtol=1e-5, atol=1e-4)
    assert float(moments.sum_w) == 10


def test_column_sums_group_rows_then_sum_in_float64():
    x = torch.randn(120, 7) * 1e3 + 5
    w = torch.rand(120)
    expected = (x.double() * w.double()[:, None]).sum(0)
    out = column_sums(x, w, 12, torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(column_sums(x, None, 7, torch.float64), x.double().sum(0), rtol=1e-6, atol=1e-3)


def test_expert_output_statistics_fold_like_expert_input_statistics():
    """fc2's statistics crossed with y_e = W_t x_e give the very system of the x_e-crossed ones."""
    d_in, d_out, alpha = 12, 5, 0.25
    xs, xe = torch.randn(4, 9, d_in, dtype=torch.float64), torch.randn(4, 9, d_in, dtype=torch.float64)
    w_t, b_t = torch.randn(d_out, d_in, dtype=torch.float64), torch.randn(d_out, dtype=torch.float64)
    weights = torch.rand(9, dtype=torch.float64)
    plain, projected = LinearMoments.zeros(d_in), ProjectedLinearMoments.zeros(d_in, d_out)
    plain.add(xs, xe, weights)
    projected.add(xs, xe @ w_t.T, weights)
    systems = [LinearSystem.empty(d_out, d_in, True, device="cpu") for _ in range(2)]
    for system, moments in zip(systems, (plain, projected)):
        system.add_task(moments, w_t, b_t, alpha=alpha, eps=1e-8)
    for name in ("lhs", "rhs", "bias_rhs", "scaled_mean_student", "scale_sum"):
        torch.testing.assert_close(getattr(systems[1], name), getattr(systems[0], name))


def test_stacked_outputs_solve_like_separate_linears():
    """q, k and v share one system with stacked outputs; each block equals its own solve."""
    d_in = 6
    moments = LinearMoments.zeros(d_in)
    moments.add(torch.randn(50, d_in, dtype=torch.float64), torch.randn(50, d_in, dtype=torch.float64))
    ws = [torch.randn(4, d_in, dtype=torch.float64) for _ in range(3)]
    bs = [torch.randn(4, dtype=torch.float64) for _ in range(3)]
    anchors_w = [torch.randn(4, d_in, dtype=torch.float64) for _ in range(3)]
    anchors_b = [torch.randn(4, dtype=torch.float64) for _ in range(3)]
    stacked = LinearSystem.empty(12, d_in, True, device="cpu")
    stacked.add_task(moments, torch.cat(ws), torch.cat(bs), alpha=0.25, eps=1e-8)
    weight, bias = stacked.solve(torch.cat(anchors_w), torch.cat(anchors_b), lam=0.05, eps=1e-8)
    for i in range(3):
        single = LinearSystem.empty(4, d_in, True, device="cpu")
        single.add_task(moments, ws[i], bs[i], alpha=0.25, eps=1e-8)
        w_i, b_i = single.solve(anchors_w[i], anchors_b[i], lam=0.05, eps=1e-8)
        torch.testing.assert_close(weight[4 * i : 4 * i + 4], w_i)
        torch.testing.assert_close(bias[4 * i : 4 * i + 4], b_i)


def test_the_general_solve_takes_lu_then_the_pseudo_inverse():
    indefinite = torch.diag(torch.tensor([2.0, -1.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(
        solve_general(indefinite, torch.ones(3, 1, dtype=torch.float64)),
        torch.tensor([[0.5], [-1.0], [1 / 3]], dtype=torch.float64),
    )
    singular = torch.zeros(3, 3, dtype=torch.float64)
    assert torch.equal(
        solve_general(singular, torch.ones(3, 1, dtype=torch.float64)), torch.zeros(3, 1, dtype=torch.float64)
    )


def test_chunk_and_flush_sizes_do_not_change_the_result(monkeypatch, device):
    """Tiny statistics chunks (several products per task) and a flush after every chunk match one
    chunk per task to float32 rounding; so does another forward batch size."""
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in ("t0", "t1")}
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t2")).eval()
    gen = torch.Generator().manual_seed(0)
    pixels = {t: torch.randn(10, 3, 32, 32, generator=gen) for t in experts}

    def run(batch: int) -> dict[str, torch.Tensor]:
        params = FeatCalParams(num_calibration_examples=10, calibration_batch_size=batch)
        calibrated = featcal_calibrate(merged, base, experts, pixels.__getitem__, params, device=device, progress=False)
        return {k: v.cpu() for k, v in calibrated.state_dict().items()}

    whole = run(10)
    monkeypatch.setattr(driver, "STATISTICS_CHUNK_TOKENS", 40)
    monkeypatch.setattr(layer_state, "FLUSH_TOKENS", 1)
    chunked = run(3)
    start = merged.state_dict()
    for key, value in whole.items():
        update = (value - start[key]).norm()
        assert (chunked[key] - value).norm() <= 1e-4 * update + 1e-7, key


def test_tasks_with_different_image_counts_match_the_plain_implementation(device):
    """A task with fewer images than the forward batch first, a larger one after: the buffers fit both."""
    import copy

    from tests.support.reference_featcal import plain_featcal

    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in ("t0", "t1")}
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t2")).eval()
    gen = torch.Generator().manual_seed(1)
    pixels = {"t0": torch.randn(3, 3, 32, 32, generator=gen), "t1": torch.randn(11, 3, 32, 32, generator=gen)}
    params = FeatCalParams(num_calibration_examples=11, calibration_batch_size=4)
    calibrated = featcal_calibrate(merged, base, experts, pixels.__getitem__, params, device=device, progress=False)
    fast = {k: v.cpu() for k, v in calibrated.state_dict().items()}
    models = []
    for ckpt in (base, *experts.values()):
        model = copy.deepcopy(merged)
        model.load_state_dict(dict(ckpt))
        models.append(model)
    plain = plain_featcal(merged, models[0], models[1:], [pixels["t0"], pixels["t1"]]).state_dict()
    start = merged.state_dict()
    for key in plain:
        if key.startswith("encoder.layers."):
            assert (fast[key] - plain[key]).norm() <= 1e-4 * (plain[key] - start[key]).norm(), key


def _system(lhs: torch.Tensor, rhs: torch.Tensor) -> LinearSystem:
    """A system with normal equations lhs·Wᵀ = rhs ([in, out]); it keeps rhs in the weight's layout."""
    system = LinearSystem.empty(rhs.shape[1], lhs.shape[0], False, device="cpu")
    system.lhs.copy_(lhs)
    system.rhs.copy_(rhs.T)
    return system


def test_linear_solve_reuses_its_workspace_and_matches_a_plain_solve():
    """Two systems of one shape are factorised in one workspace buffer; each solve equals torch.linalg.solve."""
    workspace = Workspace()
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(40, 9, generator=g, dtype=torch.float64)
        rhs, anchor_w = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
        weight, _ = _system(x.T @ x, rhs).solve(anchor_w, None, lam=0.05, eps=1e-8, workspace=workspace)
        expected = torch.linalg.solve(
            x.T @ x + (0.05 + 1e-8) * torch.eye(9, dtype=torch.float64), rhs + 0.05 * anchor_w.T
        )
        torch.testing.assert_close(weight, expected.T, rtol=1e-10, atol=1e-12)
        # The buffer's column-major view holds this system's lower Cholesky factor: the solve used it.
        factor = workspace.get("factor", (9, 9), torch.float64, torch.device("cpu")).mT
        ridged = x.T @ x + (0.05 + 1e-8) * torch.eye(9, dtype=torch.float64)
        torch.testing.assert_close(factor.tril(), torch.linalg.cholesky(ridged))


def test_linear_solve_reads_the_upper_triangle_of_the_system_alone():
    """The factorisation reads lhs's upper triangle (the Gram accumulators compute the upper block triangle):
    whatever lies below the diagonal, the weights are those of the symmetric system."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 7, generator=g, dtype=torch.float64)
    rhs, anchor_w = (
        torch.randn(7, 3, generator=g, dtype=torch.float64),
        torch.randn(3, 7, generator=g, dtype=torch.float64),
    )
    lower_garbage = x.T @ x + torch.randn(7, 7, generator=g, dtype=torch.float64).tril(-1)
    solved = [
        _system(lhs, rhs).solve(anchor_w, None, lam=0.05, eps=1e-8, workspace=Workspace())[0]
        for lhs in (x.T @ x, lower_garbage)
    ]
    assert torch.equal(solved[0], solved[1])


def test_linear_solve_falls_back_when_the_system_is_not_positive_definite():
    """An indefinite system (λ = ε = 0) fails Cholesky in the workspace and is solved by LU instead."""
    lhs = torch.diag(torch.tensor([2.0, -1.0, 3.0], dtype=torch.float64))
    weight, _ = _system(lhs, torch.ones(3, 1, dtype=torch.float64)).solve(
        torch.zeros(1, 3, dtype=torch.float64), None, lam=0.0, eps=0.0, workspace=Workspace()
    )
    torch.testing.assert_close(weight, torch.tensor([[0.5, -1.0, 1 / 3]], dtype=torch.float64))


def test_projected_fold_through_a_workspace_equals_the_fold_without():
    """fc2's C_ss·W_tᵀ product casts C_ss to the weight's float32 in a reused buffer: same result."""
    moments = ProjectedLinearMoments.zeros(10, 4)
    moments.add(torch.randn(3, 7, 10), torch.randn(3, 7, 4))
    w_t = torch.randn(4, 10)
    workspace = Workspace()
    expected = moments.teacher_rhs(0.25, w_t)
    torch.testing.assert_close(moments.teacher_rhs(0.25, w_t, workspace), expected, rtol=0, atol=0)
    assert torch.equal(workspace.get("gram", (10, 10), torch.float32, torch.device("cpu")), moments.sum_ss.float())
    torch.testing.assert_close(moments.teacher_rhs(0.25, w_t, workspace), expected, rtol=0, atol=0)


def test_a_workspace_carves_its_buffers_from_lent_memory_until_it_is_full():
    """Distinct buffers take disjoint, aligned parts of the lent memory; one that no longer fits is
    allocated on its own; asking again gives the same memory."""
    lent = torch.empty(1000, dtype=torch.uint8)
    workspace = Workspace(lent=lent)
    factor = workspace.get("factor", (10, 10), torch.float64, torch.device("cpu"))  # 800 bytes
    info = workspace.get("info", (), torch.int32, torch.device("cpu"))
    big = workspace.get("gram", (10, 10), torch.float32, torch.device("cpu"))  # 400 bytes: no room left
    start = lent.data_ptr()
    assert factor.data_ptr() == start and info.data_ptr() == start + 832  # 800 rounded up to 64 bytes
    assert big.untyped_storage().data_ptr() != lent.untyped_storage().data_ptr()
    factor.fill_(1.0)
    info.fill_(7)
    assert torch.equal(factor, torch.ones(10, 10, dtype=torch.float64)) and int(info) == 7
    assert workspace.get("factor", (10, 10), torch.float64, torch.device("cpu")).data_ptr() == start
    with pytest.raises(ValueError, match="flat uint8"):
        Workspace(lent=torch.empty(10))
