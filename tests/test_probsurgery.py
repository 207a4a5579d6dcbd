"""ProbSurgery as an evaluated-only repair of CLIP merges: its loss curve against the authors' own module and
training step on the tiny CLIP fixture (same initial modules, data order and noise draws), the mean applied
in evaluation, what its output records, and what it refuses (export and push of its output, a causal LM,
a task without data) before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from featcal.cli import main
from featcal.distributed import SINGLE
from featcal.families import get_family
from featcal.families.clip_vision.evaluation import ZeroShotEvaluator
from featcal.repairs.catalog import get_repair
from featcal.repairs.probsurgery import PROBSURGERY
from featcal.repairs.surgery_run import ProbSurgeryFeatures, modules_file, report_file, run_surgery
from featcal.suites import task_table
from tests.test_surgery import llama_data, run_error

F_ = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
GOLDEN = json.loads((F_ / "expected" / "probsurgery_authors.json").read_text())
DRAW = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
BASE = ["--base-model-id", str(F_ / "base")]
STEPS = ["--repair-param", f"steps={GOLDEN['steps']}", "--repair-param", f"batch_size={GOLDEN['batch_size']}"]
MODULES, REPORT = modules_file(PROBSURGERY), report_file(PROBSURGERY)


def test_probsurgery_is_registered_as_needing_data_and_not_releasable_with_the_published_defaults() -> None:
    repair = get_repair("probsurgery")
    assert (repair.uses_data, repair.releasable, repair.kernel) == (True, False, None)
    assert repair.defaults == {"hidden": 128, "steps": 5000, "learning_rate": 1e-3, "batch_size": 16, "kl_weight": 1e-4}


# --- against the authors' code ----------------------------------------------------------------------------


def test_the_loss_curve_and_modules_match_the_authors_to_float32_rounding() -> None:
    """featcal's embeddings and training, from the same merge, images, initial modules, batch order and noise
    as the authors' AlphaWrapper and training step (make_probsurgery_goldens.py)."""
    family = get_family("clip_vision")
    base = family.checkpoint(F_ / "base")
    merged = family.build_model(family.model_config(F_ / "base"), load_file(F_ / "expected" / GOLDEN["merged"]))
    experts = {t: family.load_model(F_ / "experts" / t, base) for t in GOLDEN["tasks"]}
    preprocessor = family.preprocessor(F_ / "base")
    table = task_table(str(F_ / "tasks.json"), replace=True)
    n, seed = GOLDEN["num_calibration_examples"], GOLDEN["seed"]
    pixels = {
        task.name: family.calibration_inputs(task, preprocessor, n, seed, world=SINGLE).inputs["pixel_values"]
        for task in table.select(GOLDEN["tasks"])
    }
    params = {k: GOLDEN[k] for k in ("hidden", "steps", "learning_rate", "batch_size", "kl_weight")}
    classifier = ZeroShotEvaluator(F_ / "base", "cpu").classifier
    result, cost = run_surgery(
        classifier, merged, experts.__getitem__, pixels, params, seed=seed, batch_size=4, repair=PROBSURGERY
    )
    assert torch.allclose(torch.tensor(result.losses), torch.tensor(GOLDEN["losses"]), rtol=2e-6, atol=0)
    expected = load_file(F_ / "expected" / "probsurgery_authors_modules.safetensors")
    assert sorted(result.modules) == sorted(expected)
    for key, value in expected.items():
        assert (result.modules[key] - value).abs().max() <= 1e-5 * value.abs().max(), key  # equal, measured
    assert all(expected[f"t{i}.log_var"].abs().max() > 0 for i in range(3))  # the variance head trained
    assert cost["seconds"] > 0 and cost["peak_host_rss_gib"] > 0


# --- from the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """The fixture's tasks file (absolute paths), its Task Arithmetic merge (κ = 0.3) and its ProbSurgery,
    evaluated."""
    root = tmp_path_factory.mktemp("probsurgery")
    table = json.loads((F_ / "tasks.json").read_text())
    for entry in table["tasks"].values():
        entry["expert"] = str(F_ / entry["expert"])
        entry["dataset"]["path"] = str(F_ / entry["dataset"]["path"])
    (root / "tasks.json").write_text(json.dumps(table))
    argv = ["-q", "merge", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW[-2:]]
    assert main([*argv, "--ta-scaling-factor", "0.3", "--output", str(root / "ta")]) == 0
    repair = ["-q", "calibrate", "--method", "probsurgery", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    assert main([*repair, *STEPS, "--evaluate", "--merged", str(root / "ta"), "--output", str(root / "ps")]) == 0
    return root


def test_calibrate_writes_the_modules_the_recipe_and_the_report(clip) -> None:
    folder = clip / "ps"
    assert sorted(p.name for p in folder.iterdir()) == ["featcal_recipe.json", MODULES, REPORT]
    modules = load_file(folder / MODULES)
    assert {k: tuple(v.shape) for k, v in modules.items()} == {
        **{f"t{i}.proj": (128, 64) for i in range(3)}, **{f"t{i}.mean": (64, 128) for i in range(3)},
        **{f"t{i}.log_var": (64, 128) for i in range(3)},
    }  # fmt: skip
    recipe = json.loads((folder / "featcal_recipe.json").read_text())
    (entry,) = recipe["repairs"]
    assert recipe["kind"] == "repair" and entry["method"] == "probsurgery"
    assert {k: entry["params"][k] for k in ("hidden", "steps", "learning_rate", "batch_size", "kl_weight")} == {
        "hidden": 128, "steps": GOLDEN["steps"], "learning_rate": 1e-3, "batch_size": GOLDEN["batch_size"],
        "kl_weight": 1e-4,
    }  # fmt: skip
    draw = entry["params"]["calibration"]
    assert (draw["num_calibration_examples"], draw["calibration_batch_size"], draw["seed"]) == (8, 4, 42)
    assert recipe["merge"] == json.loads((clip / "ta" / "featcal_recipe.json").read_text())["merge"]
    report = json.loads((folder / REPORT).read_text())
    # featcal's TA merge is FusionBench's bit for bit, so the curve's ends are the golden's
    assert report["loss_first_step"] == pytest.approx(GOLDEN["losses"][0], rel=1e-5)
    assert report["loss_last_step"] == pytest.approx(GOLDEN["losses"][-1], rel=1e-5)
    assert report["seconds"] > 0 and report["peak_host_rss_gib"] > 0
    assert sorted(report["accuracy"]) == ["t0", "t1", "t2"]
    for row in report["accuracy"].values():
        assert set(row) == {"accuracy", "loss", "accuracy_without", "loss_without"}
        assert row["loss"] != row["loss_without"]  # the modules were applied


def test_the_test_time_map_is_the_mean_on_the_unnormalised_embedding_normalised() -> None:
    """On a normalised z the map gives what the authors' classifier computes from the unnormalised
    embedding c·z (c > 0): (c z − M ReLU(P c z)) / ‖·‖; the log-variance head plays no part."""
    generator = torch.Generator().manual_seed(0)
    raw = 3 + 5 * torch.rand(6, 1, generator=generator) * torch.randn(6, 64, generator=generator)
    modules = {
        "t.proj": torch.randn(128, 64, generator=generator), "t.mean": torch.randn(64, 128, generator=generator),
        "t.log_var": torch.randn(64, 128, generator=generator),
    }  # fmt: skip
    expected = F.normalize(raw - F.relu(raw @ modules["t.proj"].T) @ modules["t.mean"].T, dim=-1)
    got = ProbSurgeryFeatures(modules, "t", torch.device("cpu"))(F.normalize(raw, dim=-1))
    assert torch.allclose(got, expected, atol=1e-5)
    other = ProbSurgeryFeatures({**modules, "t.log_var": -modules["t.log_var"]}, "t", torch.device("cpu"))
    assert torch.equal(other(F.normalize(raw, dim=-1)), got)


def test_evaluation_applies_each_task_s_module_to_its_embeddings(clip) -> None:
    """A mean head that maps z to −z (P = [I; −I], M = [2I, −2I]: M ReLU(P z) = 2z) turns every prediction
    into the least likely class: the evaluation equals negated embeddings; a zero module changes nothing."""
    family = get_family("clip_vision")
    merged = family.load_model(clip / "ta", family.checkpoint(F_ / "base"))
    evaluator = ZeroShotEvaluator(F_ / "base", "cpu")
    tasks = task_table(str(clip / "tasks.json"), replace=True).select(["t0", "t1"])
    evaluator.prepare(tasks)
    images = evaluator.test_data(tasks, batch_size=4, num_workers=0, max_samples=None)
    eye = torch.eye(64)
    flip = {"t0.proj": torch.cat([eye, -eye]), "t0.mean": torch.cat([2 * eye, -2 * eye], 1)}
    flip |= {"t0.log_var": torch.ones(64, 128)}
    flip |= {"t1.proj": torch.randn(128, 64), "t1.mean": torch.zeros(64, 128), "t1.log_var": torch.ones(64, 128)}
    classifier = evaluator.classifier

    def evaluate(task, features=None):
        return classifier.evaluate_task(merged, task, images=images, progress=False, features=features)

    plain, flipped = evaluate(tasks[0]), evaluate(tasks[0], ProbSurgeryFeatures(flip, "t0", classifier.device))
    negated = evaluate(tasks[0], lambda z: -z)
    assert flipped.accuracy == negated.accuracy and flipped.loss == pytest.approx(negated.loss, rel=1e-5)
    assert flipped.loss != pytest.approx(plain.loss) and flipped.accuracy + plain.accuracy <= 1
    kept = evaluate(tasks[1], ProbSurgeryFeatures(flip, "t1", classifier.device))
    assert kept.accuracy == evaluate(tasks[1]).accuracy
    assert kept.loss == pytest.approx(evaluate(tasks[1]).loss, rel=1e-5)


# --- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["export"], ["push", "--repo", "someone/tiny-probsurgery", "--dry-run"]])
def test_export_and_push_of_a_probsurgery_output_are_refused_in_one_line(clip, tmp_path, capsys, command) -> None:
    folder = tmp_path / "ps"
    shutil.copytree(clip / "ps", folder)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_error(capsys, [command[0], str(folder), *command[1:]])
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"featcal: error: {folder} holds a ProbSurgery result: per-task modules on top of the merge's "
        "representation, not a transformers model; it is evaluated, not exported or pushed."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no release folder
    assert sorted(p.name for p in folder.iterdir()) == ["featcal_recipe.json", MODULES, REPORT]


def test_probsurgery_without_calibration_data_is_refused_before_any_work(clip, tmp_path, capsys) -> None:
    root = tmp_path / "w"
    table = json.loads((clip / "tasks.json").read_text())
    shutil.copytree(F_ / "data" / "t1", root / "t1")
    for parquet in (root / "t1" / "data").glob("train-*"):
        parquet.unlink()
    table["tasks"]["t1"]["dataset"]["path"] = str(root / "t1")
    (root / "tasks.json").write_text(json.dumps(table))
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "probsurgery", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out)])
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: "), err
    assert "t1" in err[0] and "train" in err[0]
    assert not out.exists()


def test_a_hyper_parameter_of_another_repair_is_refused_before_any_work(clip, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "probsurgery", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out),
                                   "--repair-param", "rank=16"])  # fmt: skip
    assert code == 2 and len(err) == 1 and "Unknown parameter of repair 'probsurgery' ['rank']" in err[0], err
    assert not out.exists()


def test_probsurgery_on_a_causal_lm_merge_is_refused_in_one_line_before_any_work(tmp_path, capsys) -> None:
    (tmp_path / "data.yaml").write_text(json.dumps(llama_data(tmp_path)))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base"), "--output", str(tmp_path / "ta")]
    assert main(merge) == 0
    out = tmp_path / "out"
    code, err = run_error(capsys, ["calibrate", "--method", "probsurgery", *common, "--merged", str(tmp_path / "ta"),
                                   "--output", str(out)])  # fmt: skip
    assert code == 2 and len(err) == 1, err
    assert "--method 'probsurgery' is invalid: it must be a repair defined for " in err[0]
    assert "(family causal_lm; `featcal methods` lists the repairs): probsurgery trains its modules on a CLIP" in err[0]
    assert not out.exists()


def test_featcal_methods_lists_probsurgery_as_needing_data_and_not_releasable(capsys) -> None:
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("\nprobsurgery ") :].split("\nsurgery ")[0]
    assert "ProbSurgery  https://github.com/1998v7/ProbSurgery" in block
    assert "needs calibration data: yes" in block and "releasable: no" in block
    assert "hidden" in block and "kl_weight" in block
