"""Post-merge repairs: the registry, SVC against FusionBench and its formula, and `featcal calibrate --method`.

The goldens ``tests/fixtures/tiny-clip-3task/expected/fusionbench_svc*`` are FusionBench 0.2.33's own
``SingularValueCalibration`` on the fixture's Task Arithmetic merge (``make_svc_goldens.py``; the command
and versions are in that folder's README).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Annotated

import pytest
import torch
from safetensors.torch import load_file

from featcal.calibration.params import FeatCalParams
from featcal.cli import main
from featcal.errors import InvalidParameterError, ModelInputError, UnknownNameError
from featcal.families.clip_vision.folders import vision_checkpoint
from featcal.merging import Range
from featcal.model_recipe import ModelRecipe
from featcal.repairs.apply import repair_state
from featcal.repairs.catalog import available_repairs, get_repair
from featcal.repairs.registry import RepairRegistry, weight_repair
from featcal.repairs.svc import svc

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
TASKS = ("t0", "t1", "t2")


@pytest.fixture(scope="module")
def fixture_models():
    """The fixture's base, experts and FusionBench's Task Arithmetic merge of them (κ = 0.3)."""
    base = vision_checkpoint(F / "base")
    experts = [vision_checkpoint(F / "experts" / t) for t in TASKS]
    return base, experts, load_file(F / "expected" / "fusionbench_task_arithmetic.safetensors")


def random_models(seed: int = 0, tasks: int = 3, shape: tuple[int, int] = (12, 7)):
    """Float64 base, experts and a Task Arithmetic merge (κ = 0.3) with a matrix, a vector, a 4-D tensor
    and an integer buffer."""
    g = torch.Generator().manual_seed(seed)
    base = {
        "proj.weight": torch.randn(shape, generator=g, dtype=torch.float64),
        "proj.bias": torch.randn(shape[0], generator=g, dtype=torch.float64),
        "conv.weight": torch.randn(4, 3, 2, 2, generator=g, dtype=torch.float64),
        "position_ids": torch.arange(3),
    }
    experts = [
        {
            k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in base.items()
        }
        for _ in range(tasks)
    ]
    merged = {
        k: v + 0.3 * sum(e[k] - v for e in experts) if v.is_floating_point() else v.clone() for k, v in base.items()
    }
    return base, experts, merged


def svc_state(base, experts, merged, **params):
    return repair_state(get_repair("svc"), get_repair("svc").resolved_params(**params), base, experts, merged)


# --- the registry -------------------------------------------------------------------------------------


def test_featcal_and_svc_are_registered_with_what_they_need_and_give() -> None:
    assert available_repairs() == ["featcal", "lot", "probsurgery", "surgery", "svc"]
    featcal, svc_repair = get_repair("featcal"), get_repair("svc")
    assert (featcal.uses_data, featcal.releasable, featcal.kernel) == (True, True, None)
    assert featcal.defaults == FeatCalParams().to_dict()  # the very parameters of FeatCalParams
    assert (svc_repair.uses_data, svc_repair.releasable) == (False, True)
    assert svc_repair.defaults == {"alpha": 0.1} and svc_repair.reference_url == "https://arxiv.org/abs/2602.05536"
    with pytest.raises(
        UnknownNameError, match="Unknown repair 'adamerging'; known: featcal, lot, probsurgery, surgery, svc"
    ):
        get_repair("adamerging")


def test_featcal_s_parameters_are_checked_as_featcal_params_checks_them() -> None:
    featcal = get_repair("featcal")
    assert featcal.resolved_params(lambda_ratio="0.1")["lambda_ratio"] == 0.1
    for name, bad in [("num_calibration_examples", 0), ("lambda_ratio", -1), ("covariance_eps", "x")]:
        with pytest.raises(InvalidParameterError):
            FeatCalParams(**{name: bad})
        with pytest.raises(InvalidParameterError, match=f"repair 'featcal': {name}="):
            featcal.resolved_params(**{name: bad})


def test_a_weight_repair_declares_its_hyper_parameters_from_its_signature() -> None:
    registry = RepairRegistry()

    @weight_repair("scale", pretty_name="Scale", reference_url="https://example.org", registry=registry)
    def scale(base, experts, merged, *, factor: Annotated[float, Range(ge=0, le=2)] = 1.0):
        """Scales the merge's update."""
        return base + factor * (merged - base)

    repair = registry.get("scale")
    assert repair.description == "Scales the merge's update." and repair.defaults == {"factor": 1.0}
    assert repair.resolved_params(factor="2") == {"factor": 2.0}
    with pytest.raises(
        InvalidParameterError, match="repair 'scale': factor=3 is invalid: it must be a finite number in"
    ):
        repair.resolved_params(factor=3)
    with pytest.raises(TypeError, match=r"takes \(base, experts, merged"):
        weight_repair("bad", pretty_name="B", reference_url="", registry=registry)(lambda base, task_vectors: base)
    with pytest.raises(ValueError, match="registered twice"):
        weight_repair("scale", pretty_name="S", reference_url="", registry=registry)(scale)


# --- SVC: FusionBench's outputs and the paper's formula -----------------------------------------------


@pytest.mark.parametrize("alpha", [0.1, 0.3])
def test_svc_equals_fusionbench_to_float32_rounding(fixture_models, alpha, device) -> None:
    """Both compute in float64 (FusionBench's default, vectorised implementation) and round once to
    float32; measured equal bit for bit on every tensor on the AMD EPYC the golden was made on. Another CPU's
    LAPACK agrees in float64 to ~1e-16 (the float64 test below), which can move a value across a float32
    rounding boundary: one float32 step (2⁻²³ relative) on the CPU. On CUDA the SVD differs more."""
    base, experts, merged = fixture_models
    state = repair_state(get_repair("svc"), {"alpha": alpha}, base, experts, merged, device=torch.device(device))
    reference = load_file(F / "expected" / f"fusionbench_svc_{alpha}.safetensors")
    assert set(state) == set(reference)
    changed = [key for key in reference if not torch.equal(reference[key], merged[key])]
    assert changed, "the golden must differ from the merge it repairs"
    tolerance = dict(rtol=2**-23, atol=0) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)
    for key, want in reference.items():
        torch.testing.assert_close(state[key], want, **tolerance, msg=key)


def test_svc_in_float64_equals_fusionbench_s_float64_run(fixture_models) -> None:
    base, experts, merged = fixture_models
    reference = load_file(F / "expected" / "fusionbench_svc_0.1_float64_run.safetensors")
    for key, want in reference.items():
        if want.dim() != 2:
            continue
        b = base[key].double()
        got = svc(b, torch.stack([e[key].double() for e in experts]), merged[key].double(), alpha=0.1)
        assert (got - want).norm() <= 1e-12 * (want - b).norm(), key


def oracle(base, experts, merged, alpha: float) -> torch.Tensor:
    """The paper's formula written out one direction and one task at a time, in float64."""
    delta = merged - base
    u, sigma, vh = torch.linalg.svd(delta, full_matrices=False)
    gamma = []
    for r in range(len(sigma)):
        a = u[:, r] @ delta
        total = 0.0
        for expert in experts:
            a_i = u[:, r] @ (expert - base)
            s = float(a @ a_i) / max(float(a_i @ a_i), 1e-12)
            total += max(alpha, s)
        gamma.append(len(experts) / total)
    return base + u @ torch.diag(torch.tensor(gamma, dtype=torch.float64) * sigma) @ vh


@pytest.mark.parametrize(("seed", "alpha", "shape"), [(0, 0.1, (12, 7)), (1, 0.5, (5, 9)), (2, 2.0, (8, 8))])
def test_svc_matches_the_formula_written_out_in_float64(seed, alpha, shape) -> None:
    base, experts, merged = random_models(seed, shape=shape)
    key = "proj.weight"
    got = svc(base[key], torch.stack([e[key] for e in experts]), merged[key], alpha=alpha)
    want = oracle(base[key], [e[key] for e in experts], merged[key], alpha)
    assert (got - want).norm() <= 1e-12 * (want - base[key]).norm()
    assert not torch.allclose(got, merged[key])  # the repair moved the merge


def test_a_merge_equal_to_the_base_is_unchanged() -> None:
    base, experts, _ = random_models(3)
    state = svc_state(base, experts, {k: v.clone() for k, v in base.items()})
    assert all(torch.equal(state[k], base[k]) for k in base)


def test_only_matrices_change() -> None:
    base, experts, merged = random_models(4)
    state = svc_state(base, experts, merged)
    for key in ("proj.bias", "conv.weight", "position_ids"):
        assert torch.equal(state[key], merged[key]) and state[key].dtype == merged[key].dtype, key
    assert not torch.equal(state["proj.weight"], merged["proj.weight"])


def test_over_counting_is_undone_where_every_expert_is_the_same() -> None:
    """T identical experts summed (κ = 1): every coefficient is T, so γ = 1/T and SVC gives θ0 + τ back."""
    base, experts, _ = random_models(5, tasks=1)
    tau = experts[0]["proj.weight"] - base["proj.weight"]
    count = 4
    merged = base["proj.weight"] + count * tau
    got = svc(base["proj.weight"], torch.stack([experts[0]["proj.weight"]] * count), merged, alpha=0.1)
    torch.testing.assert_close(got, experts[0]["proj.weight"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 4.0, 1e6])
def test_alpha_bounds_every_factor_by_its_inverse(alpha) -> None:
    """γ_r ≤ 1/α: no singular value of the update grows more than 1/α times; a huge α returns the base."""
    base, experts, merged = random_models(6)
    key = "proj.weight"
    got = svc(base[key], torch.stack([e[key] for e in experts]), merged[key], alpha=alpha)
    before = torch.linalg.svdvals(merged[key] - base[key])
    after = torch.linalg.svdvals(got - base[key])
    assert (after <= before / alpha * (1 + 1e-9) + 1e-14).all()  # θ0 + Δ − θ0 rounds at 1e-16 of θ0
    if alpha == 1e6:
        torch.testing.assert_close(got, base[key], rtol=0, atol=1e-5)


def test_an_expert_equal_to_the_base_counts_as_alpha() -> None:
    """Its responses are all zero: ‖a_r^i‖² is floored, its coefficient 0, counted as α (no 0/0)."""
    base, experts, merged = random_models(7)
    experts[1] = {k: v.clone() for k, v in base.items()}
    key = "proj.weight"
    got = svc(base[key], torch.stack([e[key] for e in experts]), merged[key], alpha=0.2)
    assert torch.isfinite(got).all()
    want = oracle(base[key], [e[key] for e in experts], merged[key], 0.2)
    assert (got - want).norm() <= 1e-12 * (want - base[key]).norm()


@pytest.mark.parametrize("bad", [0, -0.1, math.nan, math.inf, "x", True])
def test_a_bad_alpha_is_refused(bad) -> None:
    with pytest.raises(
        InvalidParameterError, match="repair 'svc': alpha=.* is invalid: it must be a finite number > 0"
    ):
        get_repair("svc").resolved_params(alpha=bad)


def test_a_bfloat16_merge_is_repaired_in_float64_and_stored_in_the_base_s_dtype() -> None:
    base, experts, merged = random_models(8)
    cast = lambda state: {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}  # noqa: E731
    state = svc_state(cast(base), [cast(e) for e in experts], cast(merged))
    assert state["proj.weight"].dtype == torch.bfloat16
    state32 = repair_state(
        get_repair("svc"), {"alpha": 0.1}, cast(base), [cast(e) for e in experts], cast(merged), output_dtype="float32"
    )
    assert state32["proj.weight"].dtype == torch.float32 and state32["proj.bias"].dtype == torch.float32


# --- the recipe ---------------------------------------------------------------------------------------


def test_a_recipe_without_repairs_writes_no_repairs_entry_and_a_damaged_one_is_refused(tmp_path) -> None:
    recipe = {
        "format": "featcal-model-recipe/1", "kind": "merge", "family": "clip_vision", "base_model": "b",
        "experts": {"t": "e"}, "merge": {"method": "task_arithmetic", "params": {}, "from": None},
    }  # fmt: skip
    assert "repairs" not in ModelRecipe.from_json(recipe, tmp_path).to_json()
    chained = ModelRecipe.from_json({**recipe, "repairs": [{"method": "svc", "params": {"alpha": 0.2}}]}, tmp_path)
    assert chained.to_json()["repairs"] == [{"method": "svc", "params": {"alpha": 0.2}}]
    for damaged in ([{"params": {}}], [{"method": "svc", "params": [1]}], "svc"):
        with pytest.raises(ModelInputError, match="damaged featcal model recipe"):
            ModelRecipe.from_json({**recipe, "repairs": damaged}, tmp_path)


# --- `featcal calibrate --method svc` on the CLIP fixture ---------------------------------------------


@pytest.fixture(scope="module")
def ta_folder(tmp_path_factory) -> tuple[Path, Path]:
    """The fixture's tasks file (absolute paths) and featcal's Task Arithmetic merge of it (κ = 0.3)."""
    root = tmp_path_factory.mktemp("svc")
    table = json.loads((F / "tasks.json").read_text())
    for entry in table["tasks"].values():
        entry["expert"] = str(F / entry["expert"])
        entry["dataset"]["path"] = str(F / entry["dataset"]["path"])
    (root / "tasks.json").write_text(json.dumps(table))
    argv = ["-q", "merge", "--tasks-file", str(root / "tasks.json"), "--base-model-id", str(F / "base")]
    assert main([*argv, "--ta-scaling-factor", "0.3", "--device", "cpu", "--output", str(root / "ta")]) == 0
    return root / "tasks.json", root / "ta"


@pytest.fixture(scope="module")
def svc_folder(ta_folder) -> Path:
    out = ta_folder[1].parent / "ta-svc"
    assert main(["-q", "calibrate", "--method", "svc", "--merged", str(ta_folder[1]), "--output", str(out)]) == 0
    return out


def test_calibrate_method_svc_writes_fusionbench_s_weights_and_records_the_repair(ta_folder, svc_folder) -> None:
    weights = load_file(svc_folder / "model.safetensors")
    reference = load_file(F / "expected" / "fusionbench_svc_0.1.safetensors")
    assert all(torch.equal(weights[key], want) for key, want in reference.items())
    recipe = json.loads((svc_folder / "featcal_recipe.json").read_text())
    merged = json.loads((ta_folder[1] / "featcal_recipe.json").read_text())
    assert recipe["kind"] == "repair" and recipe["repairs"] == [{"method": "svc", "params": {"alpha": 0.1}}]
    assert recipe["merge"] == merged["merge"] and recipe["experts"] == merged["experts"]
    assert "featcal" not in recipe and "repairs" not in merged


def test_repair_param_sets_alpha(ta_folder, tmp_path) -> None:
    out = tmp_path / "svc3"
    assert main(["-q", "calibrate", "--method", "svc", "--repair-param", "alpha=0.3", "--merged", str(ta_folder[1]),
                 "--output", str(out)]) == 0  # fmt: skip
    reference = load_file(F / "expected" / "fusionbench_svc_0.3.safetensors")
    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[key], want) for key, want in reference.items())
    assert json.loads((out / "featcal_recipe.json").read_text())["repairs"][0]["params"] == {"alpha": 0.3}


def test_svc_then_featcal_records_the_chain(ta_folder, svc_folder, tmp_path) -> None:
    tasks, _ = ta_folder
    out = tmp_path / "svc-featcal"
    argv = [
        "-q",
        "calibrate",
        "--merged",
        str(svc_folder),
        "--tasks-file",
        str(tasks),
        "--base-model-id",
        str(F / "base"),
    ]
    argv += ["--num-calibration-examples", "4", "--calibration-batch-size", "2", "--device", "cpu"]
    assert main([*argv, "--output", str(out)]) == 0
    recipe = json.loads((out / "featcal_recipe.json").read_text())
    repaired = json.loads((svc_folder / "featcal_recipe.json").read_text())
    assert recipe["kind"] == "calibration" and recipe["featcal"]["num_calibration_examples"] == 4
    assert recipe["merge"] == repaired["merge"] and recipe["repairs"] == repaired["repairs"]
    calibrated, repaired_weights = load_file(out / "model.safetensors"), load_file(svc_folder / "model.safetensors")
    assert any(not torch.equal(calibrated[k], repaired_weights[k]) for k in calibrated)


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data", "texts.yaml"], "--data 'texts.yaml' is invalid: it must be given only with a repair that reads "
         "tasks or calibration data (featcal): svc is data-free and reads the base and experts its --merged folder "
         "records."),
        (["--num-calibration-examples", "8"], "--num-calibration-examples '8' is invalid: it must be given only with a "
         "repair that reads tasks or calibration data"),
        (["--tasks", "t0"], "--tasks ['t0'] is invalid: it must be given only with a repair that reads tasks"),
        (["--repair-param", "alpha=0"], "repair 'svc': alpha=0 is invalid: it must be a finite number > 0."),
        (["--repair-param", "beta=1"], "Unknown parameter of repair 'svc' ['beta']; known: alpha."),
    ],
)  # fmt: skip
def test_svc_refuses_what_it_would_not_read_before_any_work(ta_folder, tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "out"
    code, err = run_error(capsys, ["calibrate", "--method", "svc", "--merged", str(ta_folder[1]), "--output", str(out),
                                   *extra])  # fmt: skip
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: ") and message in err[0], err
    assert not out.exists()


def test_calibrate_refuses_an_unknown_repair_and_repair_params_for_featcal(ta_folder, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, err = run_error(
        capsys, ["calibrate", "--method", "adamerging", "--merged", str(ta_folder[1]), "--output", str(out)]
    )
    assert code == 2 and err == [
        "featcal: error: Unknown repair 'adamerging'; known: featcal, lot, probsurgery, surgery, svc."
    ]
    code, err = run_error(
        capsys, ["calibrate", "--merged", str(ta_folder[1]), "--output", str(out), "--repair-param", "alpha=0.2"]
    )
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: --repair-param 'alpha=0.2' is invalid")
    assert "given only with a repair other than featcal, whose parameters have flags of their own" in err[0]
    assert not out.exists()


def test_svc_refuses_a_calibrated_folder_and_a_folder_without_records(ta_folder, svc_folder, tmp_path, capsys) -> None:
    calibrated = tmp_path / "calibrated"
    calibrated.mkdir()
    recipe = json.loads((svc_folder / "featcal_recipe.json").read_text())
    recipe.update(kind="calibration", featcal=FeatCalParams().to_dict(), seed=42)
    (calibrated / "featcal_recipe.json").write_text(json.dumps(recipe))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    cases = [
        (calibrated, "is calibrated with FeatCal already: svc repairs a merge; apply it to the merge the calibration "
         "started from, then calibrate its output."),
        (bare, "records no base model and experts (neither a featcal_recipe.json nor a mergekit_config.yml naming "
         "both): svc needs the models the merge started from."),
        (tmp_path / "missing", "does not exist."),
    ]  # fmt: skip
    for folder, message in cases:
        out = tmp_path / "out"
        code, err = run_error(capsys, ["calibrate", "--method", "svc", "--merged", str(folder), "--output", str(out)])
        assert code == 2 and len(err) == 1 and err[0].endswith(message), err
        assert not out.exists()


def test_featcal_methods_lists_the_repairs_with_what_they_need(capsys) -> None:
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    repairs = out[out.index("Post-merge repairs") :]
    assert "featcal            FeatCal  https://arxiv.org/abs/2605.13030" in repairs
    assert "needs calibration data: yes (each task's train examples); releasable: yes" in repairs
    assert "svc                Singular Value Calibration (SVC)  https://arxiv.org/abs/2602.05536" in repairs
    assert "needs calibration data: no (data-free: weights only); releasable: yes" in repairs
    assert "alpha: float > 0 = 0.1" in repairs and "lambda_ratio: float >= 0 = 0.05" in repairs


def test_the_registry_s_featcal_entry_lists_every_featcal_parameter() -> None:
    names = [f.name for f in dataclasses.fields(FeatCalParams)]
    assert [p.name for p in get_repair("featcal").params] == names


def test_a_run_from_a_repaired_folder_is_refused_before_the_run_folder_is_written(
    ta_folder, svc_folder, tmp_path, capsys
):
    """A run's record and card describe the merge it starts from, not yet its repairs: refused in one line."""
    tasks, _ = ta_folder
    out = tmp_path / "run"
    argv = ["run", "--tasks-file", str(tasks), "--base-model-id", str(F / "base"), "--skip-ta", "--ta-model-path"]
    argv += [str(svc_folder), "--num-calibration-examples", "4"]
    code, err = run_error(capsys, [*argv, "--output-dir", str(out), "--device", "cpu"])
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(
        "is invalid: it must be a merged folder without repairs: this one's merge was repaired (svc), which a run "
        "does not record yet; calibrate it with `featcal calibrate --merged DIR` instead (docs/repairs.md)."
    )
    assert not out.exists()


def test_svc_under_torchrun_is_refused_in_one_line(ta_folder, tmp_path, capsys, monkeypatch) -> None:
    """A world of several processes (as torchrun starts) is refused before any model is read."""
    import contextlib

    import featcal.distributed
    import featcal.repairs.apply

    @contextlib.contextmanager
    def two_processes(device, timeout):
        yield featcal.distributed.World(rank=0, size=2, backend="gloo")

    def read(*args, **kwargs):
        raise AssertionError("no model is read under torchrun")

    monkeypatch.setattr(featcal.distributed, "session", two_processes)
    monkeypatch.setattr(featcal.repairs.apply, "recorded_inputs", read)
    out = tmp_path / "out"
    code, err = run_error(capsys, ["calibrate", "--method", "svc", "--merged", str(ta_folder[1]), "--output", str(out)])
    assert code == 2 and err == [
        "featcal: error: featcal calibrate --method svc runs in one process: start it without torchrun."
    ]
    assert not out.exists()
