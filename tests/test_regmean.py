"""RegMean and RegMean++: FusionBench 0.2.33's outputs on the tiny fixture, and the closed form's properties.

The goldens (``tests/fixtures/tiny-clip-3task/expected/fusionbench_regmean*``) are FusionBench's own
``RegMeanAlgorithmForCLIP`` and ``RegMeanAlgorithmForCLIPPlusPlus`` run on the fixture with the very
pixels featcal feeds (8 images per task, seed 42): ``make_regmean_goldens.py`` beside them, and the
fixture's README, say how.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.errors import InvalidParameterError
from featcal.merging import get_method
from featcal.merging.regmean_solve import RegMeanSystem, reduce_non_diagonal
from tests.support.merge_data import fixture_merge

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"

# Tolerances, per tensor, on ‖ours − theirs‖ / ‖theirs‖:
# * against FusionBench's float64 run (its code, float64 models and pixels: its answer without rounding),
#   featcal in float32 is 1.5e-7 away (1 and 2 torch threads, calibration batches of 3 and 4 alike): float32
#   forwards and Gram products, whose rounding the solve amplifies by the systems' conditioning. 1e-6
#   leaves a margin of 7; on a GPU, whose float32 rounding differs, 1e-5.
F32_VS_EXACT = {"cpu": 1e-6, "cuda": 1e-5}
# * featcal in float64 against the same run: the same formula in two codes, 6.5e-14 apart, float64
#   rounding (1.1e-16) amplified by the systems' conditioning (≤ 1e3 here) and two orders of summation.
F64_VS_EXACT = 1e-12
# * against FusionBench's float32 run: that run is itself 2.72e-5 (RegMean) and 2.35e-5 (RegMean++) from
#   its float64 one, and featcal is 1.5e-7 from that: the distance measured is FusionBench's rounding.
F32_VS_FUSIONBENCH_F32 = 5e-5


def relative_errors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖ours − theirs‖ / ‖theirs‖ per tensor, in float64."""
    return {
        key: float((ours[key].double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        for key, want in theirs.items()
    }


GOLDENS = [
    ("regmean", 0.95, "fusionbench_regmean"),
    ("regmean", 0.6, "fusionbench_regmean_0.6"),
    ("regmean_plusplus", 0.95, "fusionbench_regmean_plusplus"),
]


@pytest.mark.parametrize(("method", "ratio", "golden"), GOLDENS)
def test_float32_merge_equals_fusionbench_to_float32_rounding(method, ratio, golden, device) -> None:
    base, experts, data = fixture_merge()
    merged = get_method(method)(base, experts, data=data, device=device, reduce_non_diagonal_ratio=ratio)
    exact = load_file(F / "expected" / f"{golden}_float64_run.safetensors")
    assert set(merged) == set(exact) and all(merged[k].dtype == base[k].dtype for k in base)
    errors = relative_errors(merged, exact)
    assert max(errors.values()) <= F32_VS_EXACT[torch.device(device).type], errors
    if (F / "expected" / f"{golden}.safetensors").is_file():  # FusionBench's own float32 run
        assert max(relative_errors(merged, load_file(F / "expected" / f"{golden}.safetensors")).values()) <= (
            F32_VS_FUSIONBENCH_F32
        )


@pytest.mark.parametrize(("method", "ratio", "golden"), GOLDENS)
def test_float64_merge_is_fusionbenchs_formula(method, ratio, golden) -> None:
    base, experts, data = fixture_merge(torch.float64)
    merged = get_method(method)(base, experts, data=data, reduce_non_diagonal_ratio=ratio)
    errors = relative_errors(merged, load_file(F / "expected" / f"{golden}_float64_run.safetensors"))
    assert max(errors.values()) <= F64_VS_EXACT, errors


def test_regmean_plus_plus_keeps_the_base_after_the_layers_and_averages_the_stem() -> None:
    base, experts, data = fixture_merge()
    merged = get_method("regmean_plusplus")(base, experts, data=data)
    for key in base:
        if key.startswith("post_layernorm."):
            assert torch.equal(merged[key], base[key]), key
        if key.startswith(("embeddings.", "pre_layrnorm.")):
            torch.testing.assert_close(merged[key], torch.stack([e[key] for e in experts]).mean(0), msg=key)


def test_excluded_tensors_keep_the_base_and_the_others_do_not_move() -> None:
    """Exclusion picks values, not statistics: every other tensor is what it is without it. RegMean++
    exempts its stem, as FusionBench does (its embeddings are merged outside the layer loop)."""
    base, experts, data = fixture_merge()
    pattern = r"encoder\.layers\.1\.mlp\.|embeddings\."
    for method in ("regmean", "regmean_plusplus"):
        plain = get_method(method)(base, experts, data=data)
        excluded = get_method(method)(base, experts, data=data, exclude_param_names_regex=pattern)
        for key in base:
            kept = key.startswith("encoder.layers.1.mlp.") or (method == "regmean" and key.startswith("embeddings."))
            assert torch.equal(excluded[key], base[key] if kept else plain[key]), (method, key)


def test_a_bad_regular_expression_is_refused_before_any_work() -> None:
    for method in ("regmean", "regmean_plusplus"):
        with pytest.raises(InvalidParameterError, match=rf"^merging method '{method}': exclude_param_names_regex="):
            get_method(method).resolved_params(exclude_param_names_regex="(")


def test_a_data_using_method_without_data_names_what_is_missing() -> None:
    base, experts, data = fixture_merge()
    with pytest.raises(InvalidParameterError, match="calibration data of each of the 3 experts"):
        get_method("regmean")(base, experts)
    with pytest.raises(InvalidParameterError, match="calibration data"):
        get_method("regmean")(base, experts[:2], data=data)


def test_regmean_system_is_the_closed_form_in_float64() -> None:
    """(Σ G̃_t)⁻¹ Σ G̃_t W_tᵀ with the off-diagonals of each Gram scaled, folded task by task."""
    g = torch.Generator().manual_seed(0)
    grams, weights = [], []
    for _ in range(3):
        x = torch.randn(40, 6, generator=g, dtype=torch.float64)
        grams.append(x.T @ x / 40)
        weights.append(torch.randn(4, 6, generator=g, dtype=torch.float64))
    system = RegMeanSystem.empty(6, 4, device="cpu")
    for gram, weight in zip(grams, weights):
        system.add_task(gram, weight, 0.3)
    # FusionBench's mask, built in float32: diag(1 − r) + r
    mask = (torch.diag(torch.ones(6) - 0.3) + torch.full((6, 6), 0.3)).double()
    lhs = sum(gram * mask for gram in grams)
    rhs = sum((gram * mask) @ weight.T for gram, weight in zip(grams, weights))
    torch.testing.assert_close(system.solve(), torch.linalg.inv(lhs).matmul(rhs).T, rtol=1e-12, atol=1e-12)
    assert torch.equal(reduce_non_diagonal(grams[0], 1.0), grams[0])
    assert torch.equal(reduce_non_diagonal(grams[0], 0.0), torch.diag(grams[0].diagonal()))


def test_one_task_or_equal_experts_give_the_expert_back() -> None:
    """RegMean of one expert, or of identical experts, is that expert whatever the Grams."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 5, generator=g, dtype=torch.float64)
    system = RegMeanSystem.empty(5, 3, device="cpu")
    for _ in range(2):
        x = torch.randn(9, 5, generator=g, dtype=torch.float64)
        system.add_task(x.T @ x, weight, 0.6)
    torch.testing.assert_close(system.solve(), weight, rtol=1e-10, atol=1e-10)
