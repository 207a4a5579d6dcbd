"""How far float32 rounding moves a FeatCal calibration, and the one comparison the tests make with it.

A calibrated tensor is compared with an expected one relative to the calibration's update,
‖ours − expected‖ / ‖expected − merged‖, so the measure means the same for a bias and a weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# The float32 rounding of the calibration on the tiny-clip-3task fixture, on that measure
# (`python benchmarks/golden_spread.py`, results/golden_spread.json; the settings of the golden run):
# - Other kernels, on an AMD EPYC with AVX-512: MKL's COMPATIBLE branch moves the calibrated weights
#   4.3e-5 from the golden ones, ATen without SIMD 3.6e-5, oneDNN capped at SSE4.1 3.6e-5, all three
#   4.4e-5; the largest difference between two of these float32 runs is 5.1e-5. An Intel Xeon with
#   AVX-512 wrote weights 1.29e-5 from the golden ones. Thread counts, MKL's instruction caps, ATen's
#   AVX2 and oneDNN's AVX2 change no bit there. The worst tensor is always a bias (layer 1's fc2), whose
#   solve subtracts large means.
# - float64: FeatCal's engine on a float64 model, and the plain float64 implementation of
#   tests/support/reference_featcal.py, agree to 1.3e-7; every float32 run above lies 4.9e-5 to
#   6.0e-5 from them (the golden one 5.3e-5). So two float32 runs may differ by up to about 1.2e-4.
# Twice that bound: 2.5e-4. A real change moves the weights at least 400 times further (α 0.25 → 0.30:
# 0.109; λ 0.05 → 0.06: 0.12; calibration seed 42 → 43: 1.57).
FLOAT32_UPDATE_TOLERANCE = 2.5e-4


def update_differences(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
) -> dict[str, float]:
    """‖state − expected‖ / ‖expected − start‖ (in float64) for every tensor of ``expected`` under ``prefix``
    that differs from ``start``: the calibrated tensors, with ``start`` the merged model."""
    differences = {}
    for key, value in expected.items():
        if not key.startswith(prefix):
            continue
        update = (value.double() - start[key].double()).norm()
        if update > 0:
            differences[key] = float((state[key].double() - value.double()).norm() / update)
    return differences


def worst_update_difference(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
) -> tuple[float, str]:
    """The largest of :func:`update_differences` and its tensor; raises when no tensor was updated."""
    differences = update_differences(state, expected, start, prefix=prefix)
    assert differences, "no tensor differs from the start: the comparison would mean nothing"
    key = max(differences, key=differences.get)
    return differences[key], key
