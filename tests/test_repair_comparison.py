"""`featcal run --repair ...`: several repairs on one run's merge, on the run's calibration draw, each measured
in its own process, each with its defaults or with hyper-parameters of its own (`svc:alpha=0.3`, the same repair
under two settings); their results in the run folder, the model card and `featcal compare RUN`; and what is
refused before any work (an unknown or repeated repair, a malformed, unknown, mistyped or out-of-range
hyper-parameter, a repair not defined for the family, a repair that reads data when a task has none), on the
tiny CLIP fixture, a tiny Llama and a tiny T5."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from featcal.cli import main
from featcal.release.check import check_release
from featcal.repairs import comparison
from featcal.repairs.catalog import get_repair
from featcal.repairs.entries import ComparedRepair
from featcal.spec import RunSpec
from tests.test_surgery import llama_data, run_error, t5_data

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
TASKS = ("t0", "t1", "t2")
REPAIRS = ("featcal", "svc", "svc:alpha=0.3", "surgery", "probsurgery:steps=40")  # the module fixture's comparison
STEMS = ("featcal", "svc", "svc@alpha=0.3", "surgery", "probsurgery@steps=40")  # their result files and folders
ROWS = ["| merge (no repair)", "| featcal", "| probsurgery:steps=40", "| surgery", "| svc", "| svc:alpha=0.3"]
DRAW = ["--num-calibration-examples", "8", "--device", "cpu", "--threads", "1"]


def tasks_file(root: Path, without_train: str | None = None) -> Path:
    """The fixture's tasks file with absolute paths (one task's dataset without its train split, if asked)."""
    table = json.loads((F / "tasks.json").read_text())
    for entry in table["tasks"].values():
        entry["expert"] = str(F / entry["expert"])
        entry["dataset"]["path"] = str(F / entry["dataset"]["path"])
    if without_train is not None:
        shutil.copytree(F / "data" / without_train, root / without_train)
        for parquet in (root / without_train / "data").glob("train-*"):
            parquet.unlink()
        table["tasks"][without_train]["dataset"]["path"] = str(root / without_train)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tasks.json").write_text(json.dumps(table))
    return root / "tasks.json"


def run_argv(tasks: Path, out: Path) -> list[str]:
    return ["run", "--tasks-file", str(tasks), "--base-model-id", str(F / "base"), *DRAW, "--output-dir", str(out)]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    """A run of the fixture whose merge FeatCal, SVC (at its default α and at α 0.3), Representation Surgery and
    ProbSurgery (40 steps) repaired side by side."""
    root = tmp_path_factory.mktemp("compare")
    out = root / "run"
    assert main(["-q", *run_argv(tasks_file(root), out), "--repair", *REPAIRS]) == 0
    return out


def test_each_repair_is_recorded_with_its_accuracy_time_and_peak_memory(compared) -> None:
    results = {name: json.loads((compared / "repairs" / f"{name}.json").read_text()) for name in ("featcal", "svc")}
    run_id = json.loads((compared / "run_config.json").read_text())["run_id"]
    for name, result in results.items():
        assert result["run_id"] == run_id and result["repair"] == name and result["releasable"] is True
        assert result["seconds"] > 0 and result["peak_rss_bytes"] > 0 and result["floor"]["peak_rss_bytes"] > 0
        assert sorted(k for k in result["metrics"] if k in TASKS) == list(TASKS) and "average" in result["metrics"]
        assert (compared / "repairs" / name / "model.safetensors").is_file()
    assert results["svc"]["params"] == {"alpha": 0.1}
    assert results["featcal"]["params"]["num_calibration_examples"] == 8


def test_the_compared_featcal_is_the_run_s_own_calibration(compared) -> None:
    """Same merge, same draw (n, seed): the FeatCal of the comparison gives the run's weights and scores."""
    mine = load_file(compared / "repairs" / "featcal" / "model.safetensors")
    runs = load_file(compared / "featcal-ta" / "model.safetensors")
    assert mine.keys() == runs.keys() and all(mine[k].equal(runs[k]) for k in mine)
    stage = json.loads((compared / "featcal-ta" / "metrics.json").read_text())
    result = json.loads((compared / "repairs" / "featcal.json").read_text())["metrics"]
    assert {t: result[t]["accuracy"] for t in TASKS} == {t: stage[t]["accuracy"] for t in TASKS}
    merge = json.loads((compared / "repairs" / "merge.json").read_text())["metrics"]
    ta = json.loads((compared / "ta" / "metrics.json").read_text())
    assert {t: merge[t]["accuracy"] for t in TASKS} == {t: ta[t]["accuracy"] for t in TASKS}


def test_compare_prints_the_table_of_the_results(compared, capsys) -> None:
    capsys.readouterr()
    assert main(["compare", str(compared)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| repair | t0 | t1 | t2 | average | wall s | peak RSS GiB | releasable |"
    svc = json.loads((compared / "repairs" / "svc.json").read_text())
    scores = " | ".join(f"{100 * svc['metrics'][t]['accuracy']:.2f}" for t in (*TASKS, "average"))
    assert f"| svc | {scores} | {svc['seconds']:.1f} | {svc['peak_rss_bytes'] / 2**30:.2f} | yes |" in lines
    order = [line.split(" | ")[0] for line in lines[2:8]]
    assert order == ROWS  # the merge, FeatCal, then by name, a repair's settings by label


def test_the_card_shows_the_comparison_and_the_release_still_checks(compared) -> None:
    card = (compared / "release" / "README.md").read_text()
    assert "## Post-merge repairs side by side" in card and "| svc | " in card and "| featcal | " in card
    check_release(compared / "release")  # the manifest covers the card as written


def test_a_resumed_run_keeps_the_results_and_runs_no_repair_again(compared, monkeypatch) -> None:
    before = {p.name: p.read_bytes() for p in (compared / "repairs").glob("*.json")}

    def no_child(*args, **kwargs):
        raise AssertionError("a repair ran again")

    monkeypatch.setattr(comparison, "measure_child", no_child)
    argv = run_argv(compared.parent / "tasks.json", compared)
    assert main(["-q", *argv, "--repair", *REPAIRS]) == 0
    assert {p.name: p.read_bytes() for p in (compared / "repairs").glob("*.json")} == before


def test_surgery_is_compared_with_its_modules_and_never_released(compared, capsys) -> None:
    """Representation Surgery through --repair: its modules evaluated on the merge, its row marked not releasable
    in the card and the table, and the released model still the run's own FeatCal calibration."""
    result = json.loads((compared / "repairs" / "surgery.json").read_text())
    assert result["releasable"] is False and result["uses_data"] is True
    assert {k: result["params"][k] for k in ("rank", "steps")} == {"rank": 16, "steps": 1000}  # published defaults
    assert result["params"]["calibration"]["num_calibration_examples"] == 8  # the run's draw
    assert 0 < result["own_seconds"] < result["seconds"] and result["peak_rss_bytes"] > 0
    assert all(0 <= result["metrics"][t]["accuracy"] <= 1 for t in TASKS)
    merge = json.loads((compared / "repairs" / "merge.json").read_text())["metrics"]
    assert [result["metrics"][t]["loss"] for t in TASKS] != [merge[t]["loss"] for t in TASKS]  # modules applied
    assert not (compared / "repairs" / "surgery" / "model.safetensors").exists()
    card = (compared / "release" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| surgery | "))
    assert row.endswith(" | no (modules) |")
    released = load_file(compared / "release" / "model.safetensors")
    runs = load_file(compared / "featcal-ta" / "model.safetensors")
    assert released.keys() == runs.keys() and all(released[k].equal(runs[k]) for k in runs)
    capsys.readouterr()
    assert main(["compare", str(compared)]) == 0
    assert row in capsys.readouterr().out.splitlines()


def test_the_same_repair_under_two_settings_has_its_own_result_and_row(compared, tmp_path, capsys) -> None:
    """``svc`` and ``svc:alpha=0.3`` in one comparison: two result files and output folders, the hyper-parameter
    recorded and given to the repair's process (its weights are ``featcal calibrate --method svc --repair-param
    alpha=0.3``'s, bit for bit, and differ from the default's), and a row each, labelled by its setting."""
    folder = compared / "repairs"
    default, other = (json.loads((folder / f"{stem}.json").read_text()) for stem in ("svc", "svc@alpha=0.3"))
    assert (default["params"], other["params"], other["setting"]) == ({"alpha": 0.1}, {"alpha": 0.3}, {"alpha": 0.3})
    assert "setting" not in default and other["identity"] != default["identity"]
    alone = tmp_path / "svc03"
    argv = ["calibrate", "--method", "svc", "--repair-param", "alpha=0.3", "--merged", str(compared / "ta")]
    assert main(["-q", *argv, "--output", str(alone), "--threads", "1"]) == 0
    mine, direct = load_file(folder / "svc@alpha=0.3" / "model.safetensors"), load_file(alone / "model.safetensors")
    assert mine.keys() == direct.keys() and all(mine[k].equal(direct[k]) for k in mine)
    at_default = load_file(folder / "svc" / "model.safetensors")
    assert any(not mine[k].equal(at_default[k]) for k in mine)
    capsys.readouterr()
    assert main(["compare", str(compared)]) == 0
    lines = capsys.readouterr().out.splitlines()
    scores = " | ".join(f"{100 * other['metrics'][t]['accuracy']:.2f}" for t in (*TASKS, "average"))
    cost = f"{other['seconds']:.1f} | {other['peak_rss_bytes'] / 2**30:.2f}"
    assert f"| svc:alpha=0.3 | {scores} | {cost} | yes |" in lines
    card = (compared / "release" / "README.md").read_text()
    assert "\n| svc:alpha=0.3 | " in card and "\n| svc | " in card


def test_an_entry_without_hyper_parameters_writes_what_it_wrote_before(compared) -> None:
    """A default entry keeps the name alone (``svc.json``, ``svc/``) and the keys of its result, and its identity
    is the run's id, the merged weights, the command ``featcal -q calibrate --method svc --merged TA --output
    RUN/repairs/svc`` with the run's options, and the repair's defaults (α 0.1), no more."""
    from featcal.metrics import weights_sha256

    assert sorted(p.name for p in (compared / "repairs").iterdir()) == sorted(
        [*STEMS, *(f"{stem}.json" for stem in STEMS), "merge.json"]
    )
    result = json.loads((compared / "repairs" / "svc.json").read_text())
    assert list(result) == ["repair", "pretty_name", "releasable", "uses_data", "params", "run_id", "identity",
                            "seconds", "peak_rss_bytes", "floor", "threads", "metrics"]  # fmt: skip
    argv = ["-q", "calibrate", "--method", "svc", "--merged", str(compared / "ta"), "--output",
            str(compared / "repairs" / "svc"), "--device", "cpu", "--threads", "1"]  # fmt: skip
    identity = comparison.result_identity(result["run_id"], weights_sha256(compared / "ta"), argv, {"alpha": 0.1})
    assert result["identity"] == identity


def test_probsurgery_is_compared_with_its_own_steps_and_never_released(compared, tmp_path, capsys) -> None:
    """ProbSurgery through --repair with a hyper-parameter of its own: its modules trained for 40 steps (its other
    hyper-parameters at their published defaults) on the run's draw, evaluated on the merge, its row marked not
    releasable, and its output refused by ``featcal export`` in one line, as a ProbSurgery output is."""
    result = json.loads((compared / "repairs" / "probsurgery@steps=40.json").read_text())
    assert (result["repair"], result["releasable"], result["setting"]) == ("probsurgery", False, {"steps": 40})
    params = {k: result["params"][k] for k in ("hidden", "steps", "learning_rate", "batch_size", "kl_weight")}
    assert params == {"hidden": 128, "steps": 40, "learning_rate": 1e-3, "batch_size": 16, "kl_weight": 1e-4}
    assert result["params"]["calibration"]["num_calibration_examples"] == 8 and 0 < result["own_seconds"]
    merge = json.loads((compared / "repairs" / "merge.json").read_text())["metrics"]
    assert [result["metrics"][t]["loss"] for t in TASKS] != [merge[t]["loss"] for t in TASKS]  # modules applied
    output = compared / "repairs" / "probsurgery@steps=40"
    assert sorted(p.name for p in output.iterdir()) == [
        "featcal_recipe.json", "probsurgery_modules.safetensors", "probsurgery_report.json"
    ]  # fmt: skip
    card = (compared / "release" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| probsurgery:steps=40 | "))
    assert row.endswith(" | no (modules) |")
    folder = tmp_path / "ps"
    shutil.copytree(output, folder)
    code, err = run_error(capsys, ["export", str(folder)])
    assert code == 2 and err == [
        f"featcal: error: {folder} holds a ProbSurgery result: per-task modules on top of the merge's "
        "representation, not a transformers model; it is evaluated, not exported or pushed."
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ps"]  # no release folder


def test_force_on_the_command_line_redoes_every_repair(compared, tmp_path, monkeypatch) -> None:
    """``featcal run --force --repair ...`` runs each repair's process again (and the floor's) where the same
    command without --force keeps every result (above); the run's own stages are tested with --force elsewhere."""
    import featcal.pipeline

    run = tmp_path / "run"
    shutil.copytree(compared, run)
    calls: list[str] = []

    def child(args, *, what):
        if args:  # a repair's command: its output as the first run wrote it
            output = Path(args[args.index("--output") + 1])
            calls.append(output.name)
            shutil.copytree(compared / "repairs" / output.name, output)
        else:
            calls.append("floor")
        return comparison.ChildCost(1.0, 1)

    monkeypatch.setattr(comparison, "measure_child", child)
    monkeypatch.setattr(featcal.pipeline, "run_pipeline", lambda spec, world: {})
    argv = [*run_argv(compared.parent / "tasks.json", run), "--repair", *REPAIRS]
    assert main(["-q", *argv]) == 0  # the copy's commands name its own folders: computed once here
    assert calls == ["floor", *STEMS]
    kept = {name: (run / "repairs" / f"{name}.json").read_bytes() for name in STEMS}
    assert main(["-q", *argv]) == 0 and calls == ["floor", *STEMS]  # up to date: kept
    assert main(["-q", *argv, "--force"]) == 0
    assert calls == ["floor", *STEMS] * 2
    assert all(json.loads(kept[name])["seconds"] == 1.0 for name in STEMS)


@pytest.mark.parametrize("typed", [[], ["--repair", *REPAIRS]])
def test_a_recipe_names_the_repairs_and_a_typed_repair_wins(compared, tmp_path, monkeypatch, capsys, typed) -> None:
    """``repair`` in a ``--recipe`` file is the run option ``--repair``, the typed flag winning: the fixture's run
    from a recipe keeps its results (no repair runs again: a hyper-parameter mapped as ``{svc: {alpha: 0.3}}`` is
    the entry ``svc:alpha=0.3``) and prints their table; a recipe's other repair (LOT) is not run when --repair
    is typed."""
    recipe = tmp_path / "recipe.yaml"
    entries = ["featcal", "svc", {"svc": {"alpha": 0.3}}, "surgery", {"probsurgery": {"steps": 40}}]
    recipe.write_text(json.dumps({"repair": entries if not typed else ["lot"], "threads": 1}))

    def no_child(*args, **kwargs):
        raise AssertionError("a repair ran again")

    monkeypatch.setattr(comparison, "measure_child", no_child)
    capsys.readouterr()
    argv = run_argv(compared.parent / "tasks.json", compared)
    assert main(["-q", *argv, "--recipe", str(recipe), *typed]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| repair | t0 | t1 | t2 | average | wall s | peak RSS GiB | releasable |" in out
    assert [line.split(" | ")[0] for line in out if line.startswith("| ")][2:] == ROWS


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("3", "3 is invalid: it must be one or more repairs, each NAME, NAME:KEY=VALUE[,KEY=VALUE...] or "
         "{NAME: {KEY: VALUE}} (or null)."),
        ("[featcal, {svc: 0.3}]", "{'svc': 0.3} is invalid: it must be a repair's name, or "
         "NAME:KEY=VALUE[,KEY=VALUE...] with its hyper-parameters (svc:alpha=0.3), each hyper-parameter once."),
    ],
)  # fmt: skip
def test_a_recipe_s_repair_that_is_not_a_list_of_entries_is_refused_before_any_work(
    tmp_path, capsys, value, said
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"repair: {value}\n")
    out = tmp_path / "run"
    code, err = run_error(capsys, [*run_argv(tasks_file(tmp_path), out), "--recipe", str(recipe)])
    assert code == 2 and err == [f"featcal: error: recipe {recipe}: repair={said}"]
    assert not out.exists()


def test_compare_refuses_a_run_without_a_comparison(compared, tmp_path, capsys) -> None:
    (tmp_path / "run").mkdir()
    shutil.copy(compared / "run_config.json", tmp_path / "run" / "run_config.json")
    code, err = run_error(capsys, ["compare", str(tmp_path / "run")])
    assert code == 2 and err == [
        f"featcal: error: {tmp_path / 'run'} holds no repair comparison of its run: run it with "
        "`featcal run ... --repair NAME ...` first."
    ]


def language_run_compared(root: Path, build: Callable[[Path], dict]) -> Path:
    """The run of the ``--data`` file ``build`` writes in ``root``, with FeatCal and SVC compared on its merge."""
    (root / "data.yaml").write_text(json.dumps(build(root)))
    argv = ["run", "--data", str(root / "data.yaml"), "--base-model-id", str(root / "base"), *DRAW]
    assert main(["-q", *argv, "--output-dir", str(root / "run"), "--repair", "featcal", "svc"]) == 0
    return root / "run"


def assert_compared_featcal_and_release_are_the_run_s(run: Path) -> None:
    """The compared FeatCal is the run's own calibration (same merge, same draw), and so is the released model."""
    mine = load_file(run / "repairs" / "featcal" / "model.safetensors")
    runs = load_file(run / "featcal-ta" / "model.safetensors")
    assert mine.keys() == runs.keys() and all(mine[k].equal(runs[k]) for k in mine)
    released = load_file(run / "release" / "model.safetensors")
    assert released.keys() == runs.keys() and all(released[k].equal(runs[k]) for k in runs)
    check_release(run / "release")


@pytest.fixture(scope="module")
def lm_compared(tmp_path_factory) -> Path:
    """A tiny Llama run (two tasks evaluated by their loss) whose merge FeatCal and SVC repaired side by side."""
    return language_run_compared(tmp_path_factory.mktemp("lm"), llama_data)


def test_a_causal_lm_run_compares_its_repairs_and_releases_its_own_model(lm_compared, capsys) -> None:
    results = {name: json.loads((lm_compared / "repairs" / f"{name}.json").read_text()) for name in ("featcal", "svc")}
    for name, result in results.items():
        assert result["releasable"] is True and result["seconds"] > 0 and result["peak_rss_bytes"] > 0
        assert all(result["metrics"][task]["loss"] > 0 for task in ("math", "coding")), name
        assert (lm_compared / "repairs" / name / "model.safetensors").is_file()
    assert_compared_featcal_and_release_are_the_run_s(lm_compared)
    card = (lm_compared / "release" / "README.md").read_text()
    head = "| repair | math loss | coding loss | average loss | wall s | peak RSS GiB | releasable |"
    assert head in card and "A column headed `NAME loss` gives the task's loss" in card
    capsys.readouterr()
    assert main(["compare", str(lm_compared)]) == 0
    lines = capsys.readouterr().out.splitlines()
    svc = results["svc"]["metrics"]
    losses = " | ".join(f"{svc[t]['loss']:.4f}" for t in ("math", "coding", "average"))
    assert lines[0] == head and lines[4].startswith(f"| svc | {losses} | ")


@pytest.fixture(scope="module")
def t5_compared(tmp_path_factory) -> Path:
    """A tiny T5 run (two classification tasks) whose merge FeatCal and SVC repaired side by side."""
    return language_run_compared(tmp_path_factory.mktemp("t5"), t5_data)


def test_a_t5_run_compares_featcal_and_svc_and_releases_its_own_model(t5_compared, capsys) -> None:
    """FeatCal and SVC through --repair on an encoder-decoder: the compared FeatCal is the run's own calibration
    (same draw), SVC's a releasable model folder, both scored per task; the release is the run's FeatCal."""
    results = {name: json.loads((t5_compared / "repairs" / f"{name}.json").read_text()) for name in ("featcal", "svc")}
    tasks = ("sst", "nli")
    merge = json.loads((t5_compared / "repairs" / "merge.json").read_text())["metrics"]
    for name, result in results.items():
        assert result["releasable"] is True and result["seconds"] > 0 and result["peak_rss_bytes"] > 0, name
        assert all(0 <= result["metrics"][task]["exact_match"] <= 1 for task in tasks), name
        assert [result["metrics"][t]["loss"] for t in tasks] != [merge[t]["loss"] for t in tasks], name  # repaired
        assert (t5_compared / "repairs" / name / "model.safetensors").is_file()
    assert results["svc"]["params"] == {"alpha": 0.1}
    assert_compared_featcal_and_release_are_the_run_s(t5_compared)
    svc = load_file(t5_compared / "repairs" / "svc" / "model.safetensors")
    merged = load_file(t5_compared / "ta" / "model.safetensors")
    assert any(not svc[k].equal(merged[k]) for k in merged if merged[k].ndim == 2)  # SVC changed 2-D weights
    capsys.readouterr()
    assert main(["compare", str(t5_compared)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| repair | sst | nli | average | wall s | peak RSS GiB | releasable |"
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| merge (no repair)", "| featcal", "| svc"]
    svc = results["svc"]["metrics"]
    scores = " | ".join(f"{100 * svc[t]['exact_match']:.2f}" for t in tasks)
    assert lines[4].startswith(f"| svc | {scores} | ")


@pytest.mark.parametrize(
    ("repairs", "said"),
    [
        (["featcal", "nosuch"], "Unknown repair 'nosuch'; known: featcal, lot, probsurgery, surgery, svc."),
        (
            ["svc", "svc"],
            "--repair 'svc' is invalid: it must be each repair named once per setting of its "
            "hyper-parameters (repeated here).",
        ),
    ],
)
def test_an_unknown_or_repeated_repair_is_refused_before_any_work(tmp_path, capsys, repairs, said) -> None:
    out = tmp_path / "run"
    code, err = run_error(capsys, [*run_argv(tasks_file(tmp_path), out), "--repair", *repairs])
    assert code == 2 and len(err) == 1 and err[0].endswith(said), err
    assert not out.exists()


@pytest.mark.parametrize(
    ("repairs", "said"),
    [
        (["svc:alpha"], "--repair 'svc:alpha' is invalid: it must be a repair's name, or NAME:KEY=VALUE[,KEY=VALUE...] "
         "with its hyper-parameters (svc:alpha=0.3), each hyper-parameter once."),
        (["svc:alpha=0.2,alpha=0.3"], "--repair 'svc:alpha=0.2,alpha=0.3' is invalid: it must be a repair's name, "
         "or NAME:KEY=VALUE[,KEY=VALUE...] with its hyper-parameters (svc:alpha=0.3), each hyper-parameter once."),
        (["svc:alpha=["], "--repair 'svc:alpha=[' is invalid: it must be a repair's name, or "
         "NAME:KEY=VALUE[,KEY=VALUE...] with its hyper-parameters (svc:alpha=0.3), each hyper-parameter once."),
        (["svc:alpha=0.3", "svc:alpha=.3"], "--repair 'svc:alpha=0.3' is invalid: it must be each repair named once "
         "per setting of its hyper-parameters (repeated here)."),
        (["svc", "svc:alpha=0.1"], "--repair 'svc:alpha=0.1' is invalid: it must be each repair named once per "
         "setting of its hyper-parameters (the same as svc)."),
        (["featcal:num_calibration_examples=4"], "--repair 'featcal:num_calibration_examples=4' is invalid: it must "
         "be an entry that leaves num_calibration_examples to the run: every repair of a comparison reads the run's "
         "calibration draw (--num-calibration-examples, --calibration-batch-size)."),
    ],
)  # fmt: skip
def test_a_malformed_or_repeated_entry_is_refused_before_any_work(tmp_path, capsys, repairs, said) -> None:
    out = tmp_path / "run"
    code, err = run_error(capsys, [*run_argv(tasks_file(tmp_path), out), "--repair", "featcal", *repairs])
    assert code == 2 and err == [f"featcal: error: {said}"]
    assert not out.exists()


@pytest.mark.parametrize(
    ("entry", "param"),
    [("svc:beta=1", "beta=1"), ("svc:alpha=abc", "alpha=abc"), ("svc:alpha=0", "alpha=0"),
     ("surgery:rank=0", "rank=0"), ("probsurgery:steps=1.5", "steps=1.5")],
)  # fmt: skip
def test_a_hyper_parameter_is_checked_as_repair_param_checks_it_before_any_work(tmp_path, capsys, entry, param):
    """An unknown hyper-parameter, one of the wrong type and one out of range: the comparison's one line is
    ``featcal calibrate --method NAME --repair-param KEY=VALUE``'s, and no run folder is made."""
    out = tmp_path / "run"
    code, err = run_error(capsys, [*run_argv(tasks_file(tmp_path), out), "--repair", "featcal", entry])
    name = entry.split(":")[0]
    calibrate = ["calibrate", "--method", name, "--repair-param", param, "--merged", str(F / "base")]
    assert (code, err) == run_error(capsys, [*calibrate, "--output", str(tmp_path / "x")])
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: ") and f"repair '{name}'" in err[0]
    assert not out.exists() and not (tmp_path / "x").exists()


def test_a_repair_param_that_is_no_yaml_scalar_is_refused_in_one_line(tmp_path, capsys) -> None:
    """``--repair-param alpha=[`` (as an entry's ``svc:alpha=[``, above): one line, exit 2, not a YAML traceback."""
    out = tmp_path / "x"
    argv = ["calibrate", "--method", "svc", "--repair-param", "alpha=[", "--merged", str(F / "base")]
    code, err = run_error(capsys, [*argv, "--output", str(out)])
    assert code == 2 and err == [
        "featcal: error: --repair-param ['alpha=['] is invalid: it must be a mapping of names to values, or "
        "KEY=VALUE items."
    ]
    assert not out.exists()


def test_a_data_using_repair_is_refused_when_a_task_has_no_train_split(tmp_path, capsys) -> None:
    """A run that reads no train split itself (no FeatCal, a data-free merge) still has its repairs' checked."""
    out = tmp_path / "run"
    argv = [*run_argv(tasks_file(tmp_path / "w", without_train="t1"), out), "--skip-featcal", "--repair", "lot"]
    code, err = run_error(capsys, argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: "), err
    assert "t1" in err[0] and "train" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("repair", "family", "build"),
    [("surgery", "causal_lm", llama_data), ("probsurgery", "causal_lm", llama_data),
     ("probsurgery:steps=5", "seq2seq", t5_data)],
)  # fmt: skip
def test_a_module_repair_on_a_language_model_run_is_refused_before_any_work(
    tmp_path, capsys, repair, family, build
) -> None:
    (tmp_path / "data.yaml").write_text(json.dumps(build(tmp_path)))
    out = tmp_path / "run"
    argv = ["run", "--data", str(tmp_path / "data.yaml"), "--base-model-id", str(tmp_path / "base"), "--device", "cpu"]
    code, err = run_error(capsys, [*argv, "--output-dir", str(out), "--repair", "svc", repair])
    assert code == 2 and len(err) == 1, err
    name = repair.split(":")[0]
    assert f"--repair '{name}' is invalid: it must be a repair defined for " in err[0]
    assert f"(family {family}; `featcal methods` lists the repairs): {name} trains its modules on a CLIP" in err[0]
    assert not out.exists()


def test_each_child_is_given_the_run_options_its_repair_reads() -> None:
    spec = RunSpec(
        tasks_file="t.json", tasks=["a", "b"], base_model_id="base", seed=7, threads=1, merge_params={"k": 1},
        featcal=dict(num_calibration_examples=8, lambda_ratio=0.1), skip_featcal=True,
    )  # fmt: skip
    svc = comparison.repair_command(spec, get_repair("svc"), Path("m"), Path("o"))
    assert svc == ["-q", "calibrate", "--method", "svc", "--merged", "m", "--output", "o", "--threads", "1"]
    lot = comparison.repair_command(spec, get_repair("lot"), Path("m"), Path("o"))[8:]
    assert lot == ["--backbone", "b32", "--tasks", "a", "b", "--tasks-file", "t.json", "--base-model-id", "base",
                   "--num-calibration-examples", "8", "--threads", "1", "--seed", "7"]  # fmt: skip
    featcal = comparison.repair_command(spec, get_repair("featcal"), Path("m"), Path("o"))[8:]
    assert featcal == [*lot[:-4], "--lambda-ratio", "0.1", *lot[-4:]]  # FeatCal's parameters too, not the merge's


def test_each_child_is_given_its_entry_s_hyper_parameters() -> None:
    """A repair's own as ``--repair-param KEY=VALUE`` (none for a default entry: its command as before); FeatCal's
    in place of the run's values of its parameters (a value equal to the default: no flag)."""
    spec = RunSpec(
        tasks_file="t.json", tasks=["a"], base_model_id="base", threads=1,
        featcal=dict(num_calibration_examples=8, lambda_ratio=0.1), skip_featcal=True,
    )  # fmt: skip
    svc = comparison.repair_command(spec, get_repair("svc"), Path("m"), Path("o"), {"alpha": 0.3})
    assert svc[8:] == ["--repair-param", "alpha=0.3", "--threads", "1"]
    surgery = comparison.repair_command(spec, get_repair("surgery"), Path("m"), Path("o"), {"steps": 5, "rank": 2})
    assert surgery[8:12] == ["--repair-param", "steps=5", "--repair-param", "rank=2"]
    featcal = get_repair("featcal")
    run = comparison.repair_command(spec, featcal, Path("m"), Path("o"))
    other = comparison.repair_command(spec, featcal, Path("m"), Path("o"), {"lambda_ratio": 0.5, "covariance_eps": 0.1})
    default = comparison.repair_command(spec, featcal, Path("m"), Path("o"), {"lambda_ratio": 0.05})
    i = run.index("--lambda-ratio")
    assert run[i : i + 2] == ["--lambda-ratio", "0.1"] and other[i : i + 4] == [
        "--lambda-ratio", "0.5", "--covariance-eps", "0.1"
    ]  # fmt: skip
    assert "--lambda-ratio" not in default and len(default) == len(run) - 2


def test_a_child_s_peak_memory_is_its_own_not_its_parent_s() -> None:
    """A parent holding 768 MiB starts a child that needs far less (about 0.25 GiB): the child's peak is reported
    without the parent's (``ru_maxrss`` would report at least the parent's, inherited at exec)."""
    held = b"\x01" * (768 * 2**20)  # touched pages of this process
    cost = comparison.measure_child(["methods"], what="featcal methods")
    assert len(held) == 768 * 2**20
    assert 0 < cost.peak_rss_bytes < 512 * 2**20 and cost.seconds > 0


def test_a_failing_child_is_worded_with_its_last_error_line(tmp_path) -> None:
    with pytest.raises(comparison.FeatcalError) as info:
        comparison.measure_child(["compare", str(tmp_path)], what="The x repair")
    assert str(info.value).startswith("The x repair failed: featcal: error: ")


def test_a_comparison_under_torchrun_is_refused_before_any_work(tmp_path, capsys, monkeypatch) -> None:
    import contextlib

    import featcal.distributed
    import featcal.pipeline

    @contextlib.contextmanager
    def two_processes(device, timeout):
        yield featcal.distributed.World(rank=0, size=2, backend="gloo")

    def no_run(*args, **kwargs):
        raise AssertionError("the run started under torchrun")

    monkeypatch.setattr(featcal.distributed, "session", two_processes)
    monkeypatch.setattr(featcal.pipeline, "run_pipeline", no_run)
    out = tmp_path / "run"
    code, err = run_error(capsys, [*run_argv(tasks_file(tmp_path), out), "--repair", "svc"])
    assert code == 2 and err == [
        "featcal: error: featcal run --repair compares the repairs in one process: start it without torchrun."
    ]
    assert not out.exists()


def test_the_table_scores_a_language_task_by_its_exact_match_and_averages_the_tasks() -> None:
    from featcal.repairs.compare_table import score

    lm = {
        "add": {"loss": 1.0, "exact_match": 0.25},
        "cipher": {"loss": 2.0, "exact_match": 0.75},
        "average": {"loss": 1.5},
    }
    assert (score(lm, "add"), score(lm, "average")) == (0.25, 0.5)
    clip = {"t0": {"accuracy": 0.2, "loss": 1.0}, "t1": {"loss": 1.0}, "average": {"loss": 1.0}}
    assert (score(clip, "t0"), score(clip, "t1"), score(clip, "average")) == (0.2, None, None)


def _copied_run(compared, tmp_path, monkeypatch) -> tuple[RunSpec, Path, list]:
    """A copy of the compared run, its spec, and the commands of the repair children (none really started: each
    makes its output folder and costs 1 s)."""
    run = tmp_path / "run"
    shutil.copytree(compared, run)
    spec = RunSpec(
        tasks_file=str(compared.parent / "tasks.json"), base_model_id=str(F / "base"), device="cpu", threads=1,
        featcal=dict(num_calibration_examples=8), output_dir=str(run),
    )  # fmt: skip
    calls = []

    def child(args, *, what):
        calls.append(args)
        if args:  # a repair's command, not the floor's
            Path(args[args.index("--output") + 1]).mkdir()
        return comparison.ChildCost(1.0, 1)

    monkeypatch.setattr(comparison, "measure_child", child)
    return spec, run, calls


def test_an_up_to_date_result_is_kept_and_force_redoes_it(compared, tmp_path, monkeypatch) -> None:
    spec, run, calls = _copied_run(compared, tmp_path, monkeypatch)
    repairs = [ComparedRepair(get_repair("svc"))]

    def again(redo: bool) -> bool:
        return comparison.compare_repairs(spec, repairs, run, run / "ta", lambda *_: {}, redo=redo)[1]

    assert again(redo=False) and len(calls) == 2  # the copy's command names other folders: the floor and svc
    assert not again(redo=False) and len(calls) == 2  # up to date: kept
    assert again(redo=True) and len(calls) == 4  # --force


def test_a_changed_default_redoes_a_kept_result(compared, tmp_path, monkeypatch) -> None:
    """A result is kept while the repair's defaults are those it was computed with, and redone once one changes
    (as LOT's ``norms`` became true): the child's command names only what an entry sets, so it alone cannot tell."""
    import dataclasses

    spec, run, calls = _copied_run(compared, tmp_path, monkeypatch)
    svc = get_repair("svc")

    def again(repair) -> bool:
        return comparison.compare_repairs(spec, [ComparedRepair(repair)], run, run / "ta", lambda *_: {})[1]

    assert again(svc) and len(calls) == 2  # the copy's command names other folders: the floor and svc
    assert not again(svc) and len(calls) == 2  # the same defaults: kept
    alpha = dataclasses.replace(svc.params[0], default=0.2)
    changed = dataclasses.replace(svc, params=(alpha, *svc.params[1:]))
    assert comparison.repair_command(spec, changed, run / "ta", run / "repairs" / "svc") == comparison.repair_command(
        spec, svc, run / "ta", run / "repairs" / "svc"
    )  # the command alone is the same
    assert again(changed) and len(calls) == 4  # another default: redone
