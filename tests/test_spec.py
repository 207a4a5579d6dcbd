"""The run spec: flags derived from it, recipe values converted and checked, and their precedence."""

import json
import subprocess
import sys

import pytest

from featcal.cli import build_parser, main
from featcal.cli.pipeline_commands import spec_from_args
from featcal.errors import InvalidParameterError, UnknownNameError
from featcal.release.card_template import FEATCAL_PARAMS
from featcal.runfolder.record import FeatCalRecord
from featcal.spec import FeatCalParams, RunSpec, build_spec, load_recipe, recipe_keys


def spec_for(argv: list[str]) -> RunSpec:
    return spec_from_args(build_parser().parse_args(["run", *argv]))


def write_recipe(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_reference_run() -> None:
    spec = spec_for([])
    assert spec == RunSpec(eval_num_workers=spec.eval_num_workers)
    assert spec.featcal == FeatCalParams(256, 16, 0.05, 2.2, 0.25, 1e-8)
    assert (spec.merge_method, spec.method_params(), spec.seed) == ("task_arithmetic", {}, 42)


def test_every_option_has_a_flag_and_a_recipe_key() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for key in recipe_keys():
        assert f"--{key}" in help_text
    assert "--lambda-ratio λ" in help_text and "(default 0.05)" in help_text


def test_an_abbreviated_flag_wins_over_the_recipe(tmp_path) -> None:
    recipe = write_recipe(tmp_path, "lambda-ratio: 0.5\nanchor-blend-rho: 1.5\n")
    spec = spec_for(["--recipe", str(recipe), "--lambda", "0.1"])
    assert spec.featcal.lambda_ratio == 0.1  # typed, abbreviated: wins
    assert spec.featcal.anchor_blend_rho == 1.5  # from the recipe
    assert spec_for(["--recipe", str(recipe), "--lambda-ratio=0.2"]).featcal.lambda_ratio == 0.2


def test_yaml_numbers_written_as_text_are_converted(tmp_path) -> None:
    # PyYAML reads 1e-8 (no dot) as a string; "0.05" and "false" are quoted strings.
    recipe = write_recipe(tmp_path, 'covariance-eps: 1e-8\nlambda-ratio: "0.05"\neval-zero-shot: "false"\nseed: "7"\n')
    assert load_recipe(recipe)["covariance_eps"] == "1e-8"
    spec = spec_for(["--recipe", str(recipe)])
    assert spec.featcal.covariance_eps == 1e-8 and isinstance(spec.featcal.covariance_eps, float)
    assert spec.featcal.lambda_ratio == 0.05 and spec.eval_zero_shot is False and spec.seed == 7


def test_merge_params_merge_key_by_key_the_flag_winning(tmp_path) -> None:
    recipe = write_recipe(tmp_path, "merge-method: wudi\nmerge-param: {iterations: 400, lr: 1.0e-5}\n")
    spec = spec_for(["--recipe", str(recipe), "--merge-param", "lr=1e-4"])
    from featcal.merging import get_method

    # YAML reads 1e-4 as text; the method's registry converts it (its parameter is a float).
    assert spec.merge_method == "wudi" and spec.method_params() == {"iterations": 400, "lr": "1e-4"}
    assert get_method("wudi").resolved_params(**spec.method_params()) == {"iterations": 400, "lr": 1e-4}
    assert spec_for(["--ta-scaling-factor", "0.5"]).method_params() == {"scaling_factor": 0.5}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lambda: 3\n", "unknown option 'lambda'"),
        ("lambda-ratio: abc\n", "lambda-ratio='abc' is invalid: it must be a finite number >= 0"),
        ("num-calibration-examples: 2.5\n", "num-calibration-examples=2.5 is invalid: it must be a whole number >= 1"),
        ("eval-zero-shot: maybe\n", "eval-zero-shot='maybe' is invalid: it must be true or false"),
        ("anchor-blend-rho: .nan\n", "anchor-blend-rho=nan is invalid: it must be a finite number"),
        ("max-eval-samples: 0\n", "max-eval-samples=0 is invalid: it must be a whole number >= 1"),
        ("merge-param: [oops]\n", "merge-param=['oops'] is invalid"),
        ("- a\n- b\n", "expected a mapping of option names to values"),
    ],
)
def test_bad_recipe_values_name_the_key_and_the_value(tmp_path, capsys, text: str, message: str) -> None:
    recipe = write_recipe(tmp_path, text)
    out = tmp_path / "out"
    assert main(["run", "--recipe", str(recipe), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and message in err and str(recipe) in err
    assert len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--num-calibration-examples", "0"],
            "--num-calibration-examples '0' is invalid: it must be a whole number >= 1",
        ),
        (["--lambda-ratio", "-1"], "--lambda-ratio '-1' is invalid: it must be a finite number >= 0"),
        (["--eval-num-workers", "-2"], "--eval-num-workers '-2' is invalid: it must be a whole number >= 0"),
        (["--ta-scaling-factor", "inf"], "--ta-scaling-factor 'inf' is invalid: it must be a finite number"),
        (["--skip-ta"], "--ta-model-path is missing: it must be the merged model folder to start from"),
        (["--merge-param", "oops"], "--merge-param ['oops'] is invalid"),
    ],
)
def test_bad_flag_values_name_the_flag(tmp_path, capsys, argv: list[str], message: str) -> None:
    out = tmp_path / "out"
    assert main(["run", "--output-dir", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_the_python_api_names_parameters_not_flags(tmp_path) -> None:
    with pytest.raises(InvalidParameterError) as info:
        FeatCalParams(lambda_ratio=-0.1)
    assert (info.value.name, info.value.value) == ("lambda_ratio", -0.1) and "--" not in str(info.value)
    with pytest.raises(InvalidParameterError) as info:
        RunSpec(eval_batch_size="many")
    assert info.value.name == "eval_batch_size" and "--" not in str(info.value)
    with pytest.raises(UnknownNameError) as info:
        load_recipe(write_recipe(tmp_path, "lambda: 3\n"))
    assert info.value.names == ["lambda"] and "lambda-ratio" in info.value.known
    with pytest.raises(InvalidParameterError) as info:
        build_spec(recipe={"seed": -1}, recipe_source="r.yaml")
    assert (info.value.name, info.value.owner) == ("seed", "recipe r.yaml")


def test_a_spec_s_featcal_parameters_reach_the_record_and_the_card_with_their_symbols() -> None:
    """Values set on the command line are what the run record holds; the card labels each with the
    symbol and meaning the option declares (λ: the pull towards the anchor)."""
    spec = build_spec(cli={"lambda_ratio": "0.07", "teacher_interp_alpha": "0.5", "num_calibration_examples": "64"})
    recorded = FeatCalRecord(spec.featcal).to_json()
    assert (recorded["lambda_ratio"], recorded["teacher_interp_alpha"], recorded["num_calibration_examples"]) == (
        0.07,
        0.5,
        64,
    )
    assert recorded["anchor_blend_rho"] == 2.2  # untouched: the reference run's
    assert FEATCAL_PARAMS["lambda_ratio"] == ("λ", "strength of the pull towards the anchor weights")
    assert FEATCAL_PARAMS["teacher_interp_alpha"][0] == "α"


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom featcal.cli import build_parser\nbuild_parser()\n"
        "heavy = ('torch', 'transformers', 'gradio', 'datasets', 'huggingface_hub', 'jinja2')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.replace("'", '"')) == []
