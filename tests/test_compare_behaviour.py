"""`scripts/compare_behaviour.py`'s cases are wired as its docstring says, without running them (seconds).

Running a case takes minutes a side; here each case's command lines are parsed by this tree's parser (a
flag the CLI lost fails here, not after a zoo was built), the text cases read the shared zoo and the
mergekit-style folder, and that folder is made as mergekit writes one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from featcal.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_behaviour.py"


@pytest.fixture(scope="module")
def compare():
    """The script as a module (it is no package's)."""
    spec = importlib.util.spec_from_file_location("compare_behaviour", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def cases(compare, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("compare")
    return workdir, compare.build_cases(compare.CHECKOUT, workdir)


def test_every_case_is_built_and_its_commands_parse_with_this_tree(compare, cases, tmp_path) -> None:
    workdir, built = cases
    assert sorted(built) == sorted(compare.CASES)
    parser = build_parser()
    for case in built.values():
        for step in (*case.prepare(tmp_path / "prepare"), *case.steps(tmp_path / "out")):
            args = parser.parse_args(list(step.argv))
            assert args.quiet and callable(args.func), (case.name, step.name)


@pytest.mark.parametrize(
    ("zoo", "folder", "case", "steps"),
    [
        ("lm5", "tiny-lm-v1-seed0", "lm-mergekit", ["calibrate-svc", "export-svc", "merge-ties", "merge-regmean"]),
        ("t5x4", "tiny-t5-v1-seed0", "t5-mergekit", ["merge-ties", "merge-tsv"]),
    ],
)
def test_a_text_case_runs_on_the_shared_zoo(cases, tmp_path, zoo, folder, case, steps) -> None:
    workdir, built = cases
    demo = built[f"{zoo}-tiny"]
    (prepare,), (step,) = demo.prepare(tmp_path / "p"), demo.steps(tmp_path / "o")
    shared = ["--zoo", zoo, "--tiny", "--zoo-cache-dir", str(workdir / "zoo-cache")]
    assert list(prepare.argv) == ["-q", "demo", *shared, "--no-export", "--output-dir", str(tmp_path / "p" / "run")]
    assert list(step.argv) == ["-q", "demo", *shared, "--output-dir", str(tmp_path / "o" / "run")]
    mergekit = built[case]
    assert mergekit.prepare(tmp_path / "p") == demo.prepare(tmp_path / "p")  # the same zoo, built once
    argv = {s.name: s.argv for s in mergekit.steps(tmp_path / "o")}
    assert {"calibrate", "export", "merge-task_arithmetic", *steps} <= argv.keys()
    merged = str(workdir / "inputs" / case)
    assert argv["calibrate"][argv["calibrate"].index("--merged") + 1] == merged
    data = str(workdir / "zoo-cache" / "benchmark" / folder / "data.json")
    assert all(
        data in argv[name] for name in argv if name.startswith(("calibrate", "merge-")) and name != "calibrate-svc"
    )
    assert mergekit.references["calibrate-release/model.safetensors"] == f"{merged}/model.safetensors"
    for name in (name for name in argv if name.startswith("merge-")):  # only RegMean reads the calibration draw
        assert ("--num-calibration-examples" in argv[name]) == (name == "merge-regmean"), name


def test_the_mergekit_style_folder_is_the_merge_without_featcal_s_records(compare, cases, tmp_path) -> None:
    merged = tmp_path / "run" / "ta"
    merged.mkdir(parents=True)
    kept = ("model.safetensors", "config.json", "tokenizer.json", "mergekit_config.yml")
    for name in (*kept, "featcal_recipe.json", "metrics.json", "run.log"):
        (merged / name).write_text(name)
    _, built = cases
    built["lm-mergekit"].inputs(tmp_path)
    calibrate = built["lm-mergekit"].steps(tmp_path / "o")[0].argv
    made = Path(calibrate[calibrate.index("--merged") + 1])
    assert sorted(p.name for p in made.iterdir()) == sorted(kept)
    assert (made / "mergekit_config.yml").read_text() == "mergekit_config.yml"


def test_a_merge_without_a_mergekit_configuration_stops_the_comparison(compare, tmp_path, capsys) -> None:
    (tmp_path / "ta").mkdir()
    (tmp_path / "ta" / "model.safetensors").write_text("")
    with pytest.raises(SystemExit) as stop:
        compare.mergekit_folder(tmp_path / "ta", tmp_path / "made")
    assert stop.value.code == 2 and not (tmp_path / "made").exists()
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("holds no mergekit_config.yml to calibrate a mergekit-style folder from")
    )


def test_the_command_line_takes_the_new_cases(compare) -> None:
    args = compare.parse_args(["--before", "x", "--workdir", "w", "--cases", "lm5-tiny, t5-mergekit"])
    assert args.cases == ["lm5-tiny", "t5-mergekit"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--before", "x", "--workdir", "w", "--cases", "lm6-tiny"])
