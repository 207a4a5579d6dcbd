"""Merging methods: FusionBench's outputs on the tiny fixture, and properties from the papers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import pytest
import torch
from safetensors.torch import load_file

from featcal.checkpoint import Checkpoint
from featcal.cli import main
from featcal.distributed import World
from featcal.errors import FeatcalError, InvalidParameterError, UnknownNameError
from featcal.families.clip_vision.folders import vision_checkpoint
from featcal.merging import Range, available_methods, get_method, merge_method
from featcal.merging.data import MergeData
from featcal.merging.iso_c import isotropic
from featcal.merging.registry import MethodRegistry
from featcal.merging.wudi import interference_gradient, interference_loss, interference_moments, solve

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
ALL_METHODS = ["iso_c", "simple_average", "task_arithmetic", "ties", "tsv", "wudi"]


@pytest.fixture(scope="module")
def fixture_models() -> tuple[Checkpoint, list[Checkpoint]]:
    return vision_checkpoint(F / "base"), [vision_checkpoint(F / "experts" / f"t{i}") for i in range(3)]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """5,200 Adam steps on 64-wide matrices gain nothing from threads, and on a busy machine OpenMP's
    thread synchronisation made them 30× slower (8 s instead of 0.25 s per 400 steps): use one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_models(seed: int = 0, tasks: int = 3) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A small state dict with matrices, a vector, a 4-D tensor and an integer buffer, plus experts."""
    g = torch.Generator().manual_seed(seed)
    base = {
        "proj.weight": torch.randn(6, 5, generator=g),
        "proj.bias": torch.randn(6, generator=g),
        "conv.weight": torch.randn(4, 3, 2, 2, generator=g),
        "pos.weight": torch.randn(3, 5, generator=g),
        "position_ids": torch.arange(3),
    }

    def expert() -> dict[str, torch.Tensor]:
        noise = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
        return {k: v + noise[k] if k in noise else v.clone() for k, v in base.items()}

    return base, [expert() for _ in range(tasks)]


def test_all_methods_registered() -> None:
    assert set(ALL_METHODS) <= set(available_methods())


# --- FusionBench 0.2.33 on the tiny fixture ---------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "expected", "params"),
    [
        ("simple_average", "fusionbench_simple_average", {}),
        ("task_arithmetic", "fusionbench_task_arithmetic", {"scaling_factor": 0.3}),
        ("ties", "fusionbench_ties", {"scaling_factor": 0.3, "top_k": 20, "merge_func": "sum"}),
    ],
)
def test_matches_fusionbench_to_float32_rounding(
    fixture_models, method: str, expected: str, params: dict, device
) -> None:
    """Bit for bit on the CPU: these methods are element-wise float32 operations (sums over the tasks in
    their order, products by a scalar, TIES's threshold a selection, not arithmetic), which no BLAS and
    no reordered reduction touches, so every x86 CPU rounds them alike (measured equal to FusionBench's
    bits under ATen's AVX-512, AVX2 and scalar kernels, MKL's COMPATIBLE branch, oneDNN at SSE4.1 and two
    threads: `python benchmarks/comparison_spread.py`). On CUDA, within its rounding."""
    base, experts = fixture_models
    merged = get_method(method)(base, experts, device=device, **params)
    reference = load_file(F / "expected" / f"{expected}.safetensors")
    assert set(merged) == set(reference)
    tolerance = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)  # GPU rounding
    for key, want in reference.items():
        torch.testing.assert_close(merged[key], want, **tolerance, msg=key)


def test_wudi_matches_fusionbench(fixture_models, one_thread, device) -> None:
    """400 Adam steps; one step fewer is 1e-3 away on this measure, so 1e-5 pins the trajectory (1e-4
    on a GPU, whose rounding differs from the CPU's where FusionBench's result was computed). Its
    products go through MKL, so the CPU's kernels move it: measured 1.34e-6 to 1.40e-6 from
    FusionBench's under MKL's default and COMPATIBLE branches, ATen's AVX-512, AVX2 and scalar kernels
    and oneDNN at SSE4.1 (`python benchmarks/comparison_spread.py`), 7 times below 1e-5."""
    base, experts = fixture_models
    merged = get_method("wudi")(base, experts, device=device)
    reference = load_file(F / "expected" / "fusionbench_wudi.safetensors")
    assert set(merged) == set(reference)
    tolerance = 1e-5 if device == "cpu" else 1e-4
    for key, want in reference.items():
        update = (want - base[key]).norm()
        assert (merged[key] - want).norm() <= tolerance * update, key


# --- Properties shared by all methods ---------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_inputs_not_mutated_and_buffers_copied(method: str) -> None:
    base, experts = random_models()
    base_copy = {k: v.clone() for k, v in base.items()}
    experts_copy = [{k: v.clone() for k, v in e.items()} for e in experts]
    merged = get_method(method)(base, experts)
    for original, copy in zip([base, *experts], [base_copy, *experts_copy]):
        for key in copy:
            assert torch.equal(original[key], copy[key]), (method, key)
    assert set(merged) == set(base)
    assert torch.equal(merged["position_ids"], base["position_ids"])
    assert all(merged[k].dtype == base[k].dtype and merged[k].shape == base[k].shape for k in base)
    merged["position_ids"] += 1
    assert torch.equal(base["position_ids"], torch.arange(3))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_unknown_hyper_parameter_raises(method: str) -> None:
    base, experts = random_models()
    with pytest.raises(UnknownNameError, match="Unknown parameter of merging method") as caught:
        get_method(method)(base, experts, not_a_parameter=1)
    assert caught.value.names == ["not_a_parameter"]
    assert caught.value.known == list(get_method(method).defaults)


@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        ("ties", {"merge_func": "median"}, "one of sum, mean, max"),
        ("ties", {"top_k": 0}, "a finite number in (0, 100]"),
        ("ties", {"top_k": 120}, "a finite number in (0, 100]"),
        ("ties", {"top_k": float("inf")}, "a finite number in (0, 100]"),
        ("wudi", {"iterations": -1}, "a whole number >= 0"),
        ("wudi", {"iterations": 2.5}, "a whole number >= 0"),
        ("wudi", {"iterations": True}, "a whole number >= 0"),
        ("wudi", {"lr": 0.0}, "a finite number > 0"),
        ("task_arithmetic", {"scaling_factor": True}, "a finite number"),
        ("task_arithmetic", {"scaling_factor": float("nan")}, "a finite number"),
        ("task_arithmetic", {"scaling_factor": "inf"}, "a finite number"),
        ("task_arithmetic", {"scaling_factor": [0.3]}, "a finite number"),
    ],
)
def test_bad_hyper_parameter_value_raises(method: str, params: dict, expected: str) -> None:
    """Choices, ranges and types come from the signature; the error names the parameter, not a flag."""
    base, experts = random_models()
    ((name, value),) = params.items()
    with pytest.raises(FeatcalError, match=name) as caught:
        get_method(method)(base, experts, **params)
    error = caught.value
    assert isinstance(error, InvalidParameterError) and isinstance(error, ValueError)
    assert (error.name, error.expected, error.owner) == (name, expected, f"merging method {method!r}")
    assert error.value is value
    assert "--" not in str(error)


def test_numbers_given_as_text_are_read_as_numbers() -> None:
    """YAML (recipes, --merge-param) reads ``1e-4`` as a string; it must still merge as 1e-4."""
    base, experts = random_models()
    wudi = get_method("wudi")
    as_text = wudi(base, experts, lr="1e-3", iterations="3")
    as_numbers = wudi(base, experts, lr=1e-3, iterations=3)
    assert all(torch.equal(as_text[k], as_numbers[k]) for k in as_numbers)
    assert wudi.resolved_params(lr="1e-4") == {"iterations": 400, "lr": 1e-4}
    with pytest.raises(FeatcalError, match="lr='fast' is invalid: it must be a finite number"):
        wudi(base, experts, lr="fast")
    resolved = wudi.resolved_params(iterations="4e2", lr=1)
    assert resolved == {"iterations": 400, "lr": 1.0}
    assert type(resolved["iterations"]) is int and type(resolved["lr"]) is float
    assert get_method("ties").resolved_params(top_k=50, merge_func=None) == {
        "scaling_factor": 0.3,
        "top_k": 50.0,
        "merge_func": "sum",
    }


def test_unknown_method_and_no_experts_raise_with_their_data() -> None:
    with pytest.raises(UnknownNameError, match="Unknown merging method 'nope'") as caught:
        get_method("nope")
    assert caught.value.names == ["nope"] and set(ALL_METHODS) <= set(caught.value.known)
    base, _ = random_models()
    with pytest.raises(InvalidParameterError, match="experts") as empty:
        get_method("task_arithmetic")(base, [])
    assert empty.value.name == "experts" and empty.value.value == []


def test_parameters_are_listed_with_type_range_choices_and_default(capsys) -> None:
    ties = get_method("ties")
    assert ties.whole_model and not get_method("tsv").whole_model
    assert [str(p) for p in ties.params] == [
        "scaling_factor: float = 0.3",
        "top_k: float in (0, 100] = 20.0",
        "merge_func: 'sum' | 'mean' | 'max' = 'sum'",
    ]
    assert [str(p) for p in get_method("wudi").params] == ["iterations: int >= 0 = 400", "lr: float > 0 = 1e-05"]
    assert get_method("simple_average").params == ()
    assert ties.description.startswith("θ = θ0 + scaling_factor")
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for line in [
        "ties               TIES-Merging  https://arxiv.org/abs/2306.01708  → folder ties/",
        "                   top_k: float in (0, 100] = 20.0",
        "                   merge_func: 'sum' | 'mean' | 'max' = 'sum'",
        "task_arithmetic    Task Arithmetic  https://arxiv.org/abs/2212.04089  → folder ta/",
        "                   lr: float > 0 = 1e-05",
    ]:
        assert line in out.splitlines(), line


def test_half_precision_is_kept() -> None:
    base, experts = random_models()
    base = {k: v.half() if v.is_floating_point() else v for k, v in base.items()}
    experts = [{k: v.half() if v.is_floating_point() else v for k, v in e.items()} for e in experts]
    for method in ALL_METHODS:
        merged = get_method(method)(base, experts, **({"iterations": 3} if method == "wudi" else {}))
        assert merged["proj.weight"].dtype == torch.float16, method


@pytest.mark.parametrize("method", ALL_METHODS)
def test_a_bfloat16_base_merged_into_float32_keeps_the_arithmetic_s_values(method: str) -> None:
    """``dtype=float32`` returns the float32 arithmetic's result unrounded: the default (bf16) merge is its
    rounding, bit for bit, and it holds more than bf16's bits; integer buffers stay integers."""
    base, experts = random_models()
    base = {k: v.bfloat16() if v.is_floating_point() else v for k, v in base.items()}
    experts = [{k: v.bfloat16() if v.is_floating_point() else v for k, v in e.items()} for e in experts]
    params = {"iterations": 3} if method == "wudi" else {}
    narrow = get_method(method)(base, experts, **params)
    wide = get_method(method)(base, experts, dtype=torch.float32, **params)
    assert {k: v.dtype for k, v in wide.items()} == {
        k: torch.float32 if v.is_floating_point() else v.dtype for k, v in base.items()
    }
    assert all(torch.equal(wide[k].to(narrow[k].dtype), narrow[k]) for k in base)
    assert not torch.equal(wide["proj.weight"], narrow["proj.weight"].float())


# --- The kernel API ---------------------------------------------------------------------------------


def test_a_new_method_is_a_few_lines_through_the_kernel_api() -> None:
    """A per-tensor kernel in a registry of its own (the package's registry is left as it was)."""
    registry = MethodRegistry()

    @merge_method("median", pretty_name="Median", reference_url="https://example.org", registry=registry)
    def median(
        base: torch.Tensor, task_vectors: torch.Tensor, *, scaling_factor: Annotated[float, Range(ge=0)] = 1.0
    ) -> torch.Tensor:
        """θ0 plus scaling_factor times the entry-wise median of the task vectors."""
        return base + scaling_factor * task_vectors.median(dim=0).values

    method = registry.get("median")
    assert (method.name, method.pretty_name, method.reference_url) == ("median", "Median", "https://example.org")
    assert method.description == "θ0 plus scaling_factor times the entry-wise median of the task vectors."
    assert method.defaults == {"scaling_factor": 1.0} and method.inputs == ("base", "task_vectors")
    assert "median" not in available_methods() and registry.names() == ["median"]

    base, experts = random_models()
    base_copy = {k: v.clone() for k, v in base.items()}
    merged = method(base, experts, scaling_factor="0.5")
    for key, theta0 in base.items():
        if theta0.is_floating_point():
            want = theta0 + 0.5 * torch.stack([e[key] - theta0 for e in experts]).median(dim=0).values
            assert torch.equal(merged[key], want), key
        else:
            assert torch.equal(merged[key], theta0) and merged[key].data_ptr() != theta0.data_ptr()
        assert torch.equal(base[key], base_copy[key])
    with pytest.raises(InvalidParameterError, match=r"scaling_factor=-1 is invalid: it must be a finite number >= 0"):
        method(base, experts, scaling_factor=-1)
    with pytest.raises(ValueError, match="registered twice"):
        merge_method("median", pretty_name="Median", reference_url="", registry=registry)(median)


def test_kernels_may_take_the_experts_and_whole_model_methods_say_so() -> None:
    registry = MethodRegistry()

    @merge_method("pick", pretty_name="Pick", reference_url="", registry=registry)
    def pick(experts: torch.Tensor, *, index: Literal[0, 1, 2] = 0) -> torch.Tensor:
        """One expert's weights."""
        return experts[index]

    @merge_method("first", pretty_name="First", reference_url="", whole_model=True, registry=registry)
    def first(base: dict, experts: list, *, keep: bool = True) -> dict[str, torch.Tensor]:
        """The first expert, whole."""
        return {key: tensor.clone() for key, tensor in experts[0].items()}

    base, experts = random_models()
    picked = registry.get("pick")(base, experts, index=2)
    assert all(torch.equal(picked[k], experts[2][k]) for k in base)
    assert picked["proj.weight"].untyped_storage().nbytes() == picked["proj.weight"].nbytes  # not a view of all T
    with pytest.raises(InvalidParameterError, match=r"index=3 is invalid: it must be one of 0, 1, 2"):
        registry.get("pick")(base, experts, index=3)
    registry.add(
        dataclasses.replace(registry.get("pick"), name="all", pretty_name="All", fn=lambda experts, index: experts)
    )
    with pytest.raises(ValueError, match=r"merging kernel 'All' returned shape \(3, 6, 5\) for proj.weight \(6, 5\)"):
        registry.get("all")(base, experts)
    assert registry.get("first").whole_model and registry.get("first").inputs is None
    assert all(torch.equal(registry.get("first")(base, experts)[k], experts[0][k]) for k in base)
    with pytest.raises(InvalidParameterError, match="keep='maybe' is invalid: it must be true or false"):
        registry.get("first")(base, experts, keep="maybe")


def test_a_data_using_method_gets_the_data_and_checks_its_parameters_together() -> None:
    registry = MethodRegistry()
    seen = []

    def odd_only(params: dict) -> None:
        if params["k"] % 2 == 0:
            raise InvalidParameterError("k", params["k"], "odd", owner="merging method 'fed'")

    @merge_method("fed", pretty_name="Fed", reference_url="", uses_data=True, check=odd_only, registry=registry)
    def fed(base: dict, experts: list, data: MergeData, device: torch.device, world: World, *, k: int = 1) -> dict:
        """The base, once the data is seen."""
        seen.append((data.tasks, device.type, world.size, k))
        return {key: tensor.clone() for key, tensor in base.items()}

    method = registry.get("fed")
    assert method.uses_data and method.whole_model
    base, experts = random_models(tasks=2)
    data = MergeData(adapter=None, skeleton=None, tasks=("a", "b"), load_inputs=None)  # type: ignore[arg-type]
    assert torch.equal(method(base, experts, data=data, k=3)["proj.weight"], base["proj.weight"])
    assert seen == [(("a", "b"), "cpu", 1, 3)]
    with pytest.raises(InvalidParameterError, match="k=2 is invalid: it must be odd"):
        method.resolved_params(k=2)
    with pytest.raises(InvalidParameterError, match="merging method 'fed': data=None is invalid"):
        method(base, experts)
    with pytest.raises(TypeError, match=r"a data-using method takes \(base, experts, data, device, world\)"):
        merge_method("bad", pretty_name="Bad", reference_url="", uses_data=True, registry=registry)(
            lambda base, experts, data: base
        )


def no_annotation(base: torch.Tensor, task_vectors: torch.Tensor, *, k=1.0) -> torch.Tensor:
    return base


def unknown_input(base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    return base


def range_on_text(task_vectors: torch.Tensor, *, mode: Annotated[str, Range(gt=0)] = "a") -> torch.Tensor:
    return task_vectors[0]


def default_out_of_range(task_vectors: torch.Tensor, *, k: Annotated[int, Range(ge=1)] = 0) -> torch.Tensor:
    return task_vectors[0]


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (no_annotation, TypeError),
        (unknown_input, TypeError),
        (range_on_text, TypeError),
        (default_out_of_range, ValueError),
    ],
)
def test_a_kernel_with_a_bad_signature_is_refused_when_registered(fn, error: type) -> None:
    with pytest.raises(error, match="merging method 'bad'"):
        merge_method("bad", pretty_name="Bad", reference_url="", registry=MethodRegistry())(fn)


def test_a_range_has_one_or_two_bounds() -> None:
    assert [str(Range(gt=0, le=100)), str(Range(ge=1)), str(Range(lt=0.5))] == ["in (0, 100]", ">= 1", "< 0.5"]
    assert 100 in Range(gt=0, le=100) and 0 not in Range(gt=0, le=100)
    for bad in ({}, {"gt": 0, "ge": 0}, {"lt": 1, "le": 1}):
        with pytest.raises(TypeError, match="one or two bounds"):
            Range(**bad)


# --- One expert -------------------------------------------------------------------------------------


def test_one_expert_average_is_the_expert_and_ta_is_base_plus_scaled_vector() -> None:
    base, (expert,) = random_models(tasks=1)
    averaged = get_method("simple_average")(base, [expert])
    ta = get_method("task_arithmetic")(base, [expert], scaling_factor=0.7)
    for key in base:
        assert torch.equal(averaged[key], expert[key])
        if base[key].is_floating_point():
            torch.testing.assert_close(ta[key], base[key] + 0.7 * (expert[key] - base[key]))


def test_one_expert_tsv_is_base_plus_scaled_vector() -> None:
    """With T = 1 each task keeps all r singular triplets, already orthonormal: TSV-M is TA."""
    base, (expert,) = random_models(tasks=1)
    merged = get_method("tsv")(base, [expert], scaling_factor=0.6)
    for key in ("proj.weight", "pos.weight", "proj.bias", "conv.weight"):
        torch.testing.assert_close(merged[key], base[key] + 0.6 * (expert[key] - base[key]), rtol=1e-5, atol=1e-6)


# --- TIES -------------------------------------------------------------------------------------------


def ties_case() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Three tasks, 6 entries each (a 2×2 matrix and a 2-vector), worked by hand in the tests below.

    top_k = 50 %: int(6 · 0.5) = 3 entries, threshold = the 3rd smallest magnitude, and |τ| >= it is
    kept: 4 entries per task (FusionBench keeps one more than the percentage on distinct values).
    Task 1 keeps 4, −1, 2 | 3; task 2 keeps −2, −3, 5 | 1; task 3 keeps 1, 2, −6 | −4. The magnitudes
    that decide are spread over both tensors, so a per-tensor threshold would keep other entries.
    """
    base = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    vectors = [
        ([[4.0, -1.0], [2.0, 0.5]], [3.0, -0.1]),
        ([[-2.0, -3.0], [0.2, 5.0]], [-0.3, 1.0]),
        ([[1.0, 2.0], [-0.1, -6.0]], [-4.0, 0.05]),
    ]
    experts = [{"w": base["w"] + torch.tensor(w), "b": base["b"] + torch.tensor(b)} for w, b in vectors]
    return base, experts


@pytest.mark.parametrize(
    ("merge_func", "w", "b"),
    [
        # kept sums: w = [[3, −2], [2, −1]], b = [−1, 1] → elected signs [[+, −], [+, −]], [−, +]
        ("sum", [[4 + 1, -1 - 3], [2, -6]], [-4, 1]),
        ("mean", [[(4 + 1) / 2, (-1 - 3) / 2], [2, -6]], [-4, 1]),
        ("max", [[4, -3], [2, -6]], [-4, 1]),
    ],
)
def test_ties_known_answer(merge_func: str, w: list, b: list) -> None:
    base, experts = ties_case()
    merged = get_method("ties")(base, experts, scaling_factor=0.5, top_k=50, merge_func=merge_func)
    torch.testing.assert_close(merged["w"], 1 + 0.5 * torch.tensor(w, dtype=torch.float32))
    torch.testing.assert_close(merged["b"], 1 + 0.5 * torch.tensor(b, dtype=torch.float32))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_exact_cancellation_takes_the_global_majority_sign(sign: float) -> None:
    """Entry z cancels exactly (−0.5 + 0.5); the elected signs of tensor a (all ``sign``) decide it."""
    base = {"a": torch.zeros(3), "z": torch.zeros(1)}
    experts = [
        {"a": sign * torch.tensor([1.0, 2.0, 3.0]), "z": torch.tensor([-0.5])},
        {"a": sign * torch.tensor([2.0, 1.0, 1.0]), "z": torch.tensor([0.5])},
    ]
    merged = get_method("ties")(base, experts, scaling_factor=1.0, top_k=100)
    torch.testing.assert_close(merged["a"], sign * torch.tensor([3.0, 3.0, 4.0]))
    torch.testing.assert_close(merged["z"], torch.tensor([sign * 0.5]))


# --- WUDI -------------------------------------------------------------------------------------------


def test_wudi_closed_form_gradient_equals_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    tvs = torch.randn(4, 7, 5, generator=g, dtype=torch.float64)
    merged = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    interference_loss(merged, tvs).backward()
    a, b = interference_moments(tvs)
    torch.testing.assert_close(interference_gradient(merged.detach(), a, b), merged.grad, rtol=1e-12, atol=1e-12)


def test_wudi_follows_the_autograd_adam_trajectory_and_the_loss_decreases() -> None:
    """FusionBench's loop (autograd + torch Adam) and the closed form give the same iterates."""
    g = torch.Generator().manual_seed(2)
    tvs = 1e-3 * torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    reference = torch.nn.Parameter(tvs.sum(dim=0))
    optimizer = torch.optim.Adam([reference], lr=1e-5, weight_decay=0)
    losses = [interference_loss(tvs.sum(dim=0), tvs).item()]
    for step in range(1, 31):
        loss = interference_loss(reference, tvs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ours = solve(tvs, iterations=step, lr=1e-5)
        torch.testing.assert_close(ours, reference.detach(), rtol=1e-10, atol=1e-14)
        losses.append(interference_loss(ours, tvs).item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    assert losses[-1] < 0.9 * losses[0]


def test_wudi_zero_steps_is_sum_on_matrices_and_mean_elsewhere() -> None:
    base, experts = random_models()
    merged = get_method("wudi")(base, experts, iterations=0)
    for key in ("proj.weight", "pos.weight"):
        torch.testing.assert_close(merged[key], base[key] + sum(e[key] - base[key] for e in experts))
    for key in ("proj.bias", "conv.weight"):
        torch.testing.assert_close(merged[key], base[key] + sum(e[key] - base[key] for e in experts) / 3)


def test_wudi_ignores_a_task_that_left_a_tensor_unchanged() -> None:
    base, experts = random_models()
    experts[0]["proj.weight"] = base["proj.weight"].clone()
    merged = get_method("wudi")(base, experts, iterations=5)
    assert torch.isfinite(merged["proj.weight"]).all()


# --- TSV-M ------------------------------------------------------------------------------------------


def orthogonal_blocks(rows: int, cols: int, tasks: int, rank: int, seed: int) -> torch.Tensor:
    """Task matrices of rank ``rank`` whose singular subspaces are mutually orthogonal."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, tasks * rank, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, tasks * rank, generator=g, dtype=torch.float64))
    s = torch.rand(tasks, rank, generator=g, dtype=torch.float64) + 0.5
    return torch.stack(
        [u[:, i * rank : (i + 1) * rank] @ torch.diag(s[i]) @ v[:, i * rank : (i + 1) * rank].T for i in range(tasks)]
    ).float()


def test_tsv_on_orthogonal_low_rank_tasks_is_task_arithmetic() -> None:
    """Nothing to decorrelate and nothing truncated (rank 2 ≤ ⌊8/3⌋): TSV-M is the plain sum."""
    tvs = orthogonal_blocks(10, 8, tasks=3, rank=2, seed=3)
    base = {"w": torch.zeros(10, 8)}
    experts = [{"w": tv} for tv in tvs]
    merged = get_method("tsv")(base, experts, scaling_factor=1.0)
    torch.testing.assert_close(merged["w"], tvs.sum(dim=0), rtol=1e-5, atol=1e-5)


def test_tsv_spectrum_is_the_union_of_each_tasks_top_singular_values() -> None:
    base, experts = random_models(seed=4, tasks=2)
    merged = get_method("tsv")(base, experts, scaling_factor=1.0)
    update = merged["proj.weight"] - base["proj.weight"]
    per_task = 5 // 2
    kept = torch.cat([torch.linalg.svdvals(e["proj.weight"] - base["proj.weight"])[:per_task] for e in experts])
    spectrum = torch.linalg.svdvals(update)
    torch.testing.assert_close(spectrum[: kept.numel()], kept.sort(descending=True).values, rtol=1e-5, atol=1e-5)
    assert spectrum[kept.numel() :].abs().max() < 1e-5
    mean_bias = sum(e["proj.bias"] - base["proj.bias"] for e in experts) / 2
    torch.testing.assert_close(merged["proj.bias"], base["proj.bias"] + mean_bias)


# --- Iso-C ------------------------------------------------------------------------------------------


def test_iso_c_flat_spectrum_with_the_sums_singular_vectors() -> None:
    base, experts = random_models(seed=5)
    merged = get_method("iso_c")(base, experts, scaling_factor=1.5)
    total = sum(e["proj.weight"] - base["proj.weight"] for e in experts)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    update = (merged["proj.weight"] - base["proj.weight"]) / 1.5
    torch.testing.assert_close(u.T @ update @ vh.T, s.mean() * torch.eye(5), rtol=1e-5, atol=1e-5)
    mean_bias = sum(e["proj.bias"] - base["proj.bias"] for e in experts) / 3
    torch.testing.assert_close(merged["proj.bias"], base["proj.bias"] + 1.5 * mean_bias)


def test_iso_c_rank_deficient_sum_keeps_its_direction_space() -> None:
    tvs = orthogonal_blocks(9, 7, tasks=2, rank=2, seed=6)
    flat = isotropic(tvs.sum(dim=0))
    total = tvs.sum(dim=0)
    assert torch.linalg.matrix_rank(flat) == torch.linalg.matrix_rank(total) == 4
    col = torch.linalg.svd(total).U[:, :4]
    torch.testing.assert_close(col @ (col.T @ flat), flat, rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(flat)
    torch.testing.assert_close(s[:4], torch.linalg.svdvals(total)[:4].mean().expand(4), rtol=1e-5, atol=1e-5)


def test_task_arithmetic_keeps_the_embeddings_and_head_at_the_base_when_asked_and_records_it_only_then() -> None:
    """MergeBench's Task Arithmetic leaves every tensor whose name holds ``embed`` or ``lm_head`` at the base's
    values; featcal's does so with ``keep_embeddings``, a parameter left out of the record while off, so the
    records (and run ids) of runs made before it existed stay the same."""
    base = {"model.embed_tokens.weight": torch.zeros(3, 2), "lm_head.weight": torch.zeros(3, 2),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}  # fmt: skip
    experts = [{k: torch.ones_like(v) for k, v in base.items()} for _ in range(2)]
    method = get_method("task_arithmetic")
    assert method.resolved_params() == {"scaling_factor": 0.3}
    assert method.resolved_params(keep_embeddings=True) == {"scaling_factor": 0.3, "keep_embeddings": True}
    kept = method(base, experts, scaling_factor=0.4, keep_embeddings=True)
    assert torch.equal(kept["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(kept["lm_head.weight"], base["lm_head.weight"])
    assert torch.allclose(kept["model.layers.0.mlp.up_proj.weight"], torch.full((2, 2), 0.8))
    merged = method(base, experts, scaling_factor=0.4)
    assert torch.allclose(merged["model.embed_tokens.weight"], torch.full((3, 2), 0.8))
