"""Representation Surgery as an evaluated-only repair of CLIP merges: its loss curve against FusionBench's
own training code on the tiny CLIP fixture, the modules applied in evaluation, what its output records,
and what it refuses (export and push of its output, a causal LM, a task without data) before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.cli import main
from featcal.distributed import SINGLE
from featcal.families import get_family
from featcal.families.clip_vision.evaluation import ZeroShotEvaluator
from featcal.repairs.catalog import get_repair
from featcal.repairs.surgery_run import MODULES_FILE, REPORT_FILE, SurgeryFeatures, run_surgery
from featcal.suites import task_table
from tests.support.tiny_decoder import save_model, texts, tokenizer

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
GOLDEN = json.loads((F / "expected" / "fusionbench_surgery.json").read_text())
DRAW = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
BASE = ["--base-model-id", str(F / "base")]
STEPS = ["--repair-param", f"steps={GOLDEN['steps']}", "--repair-param", f"batch_size={GOLDEN['batch_size']}"]


def test_surgery_is_registered_as_needing_data_and_not_releasable_with_the_published_defaults() -> None:
    surgery = get_repair("surgery")
    assert (surgery.uses_data, surgery.releasable, surgery.kernel) == (True, False, None)
    assert surgery.defaults == {"rank": 16, "steps": 1000, "learning_rate": 1e-3, "batch_size": 16}
    assert surgery.reference_url == "https://arxiv.org/abs/2402.02705"


# --- against FusionBench's training code ------------------------------------------------------------------


def test_the_loss_curve_and_modules_match_fusionbench_s_to_float32_rounding() -> None:
    """featcal's embeddings and training, from the same merge, images, initial modules and batch order as
    FusionBench's surgery wrapper and loop (make_surgery_goldens.py)."""
    family = get_family("clip_vision")
    base = family.checkpoint(F / "base")
    merged = family.build_model(family.model_config(F / "base"), load_file(F / "expected" / GOLDEN["merged"]))
    experts = {t: family.load_model(F / "experts" / t, base) for t in GOLDEN["tasks"]}
    preprocessor = family.preprocessor(F / "base")
    table = task_table(str(F / "tasks.json"), replace=True)
    n, seed = GOLDEN["num_calibration_examples"], GOLDEN["seed"]
    pixels = {
        task.name: family.calibration_inputs(task, preprocessor, n, seed, world=SINGLE).inputs["pixel_values"]
        for task in table.select(GOLDEN["tasks"])
    }
    params = {k: GOLDEN[k] for k in ("rank", "steps", "learning_rate", "batch_size")}
    classifier = ZeroShotEvaluator(F / "base", "cpu").classifier
    result, cost = run_surgery(classifier, merged, experts.__getitem__, pixels, params, seed=seed, batch_size=4)
    assert torch.allclose(torch.tensor(result.losses), torch.tensor(GOLDEN["losses"]), rtol=2e-6, atol=0)
    assert result.losses[-1] != result.losses[0]  # it trained
    expected = load_file(F / "expected" / "fusionbench_surgery_modules.safetensors")
    assert sorted(result.modules) == sorted(expected)
    for key, value in expected.items():
        assert (result.modules[key] - value).abs().max() <= 1e-5 * value.abs().max(), key  # equal, measured
    assert cost["seconds"] > 0 and cost["peak_host_rss_gib"] > 0


# --- from the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """The fixture's tasks file (absolute paths), its Task Arithmetic merge (κ = 0.3) and its surgery, evaluated."""
    root = tmp_path_factory.mktemp("surgery")
    table = json.loads((F / "tasks.json").read_text())
    for entry in table["tasks"].values():
        entry["expert"] = str(F / entry["expert"])
        entry["dataset"]["path"] = str(F / entry["dataset"]["path"])
    (root / "tasks.json").write_text(json.dumps(table))
    argv = ["-q", "merge", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW[-2:]]
    assert main([*argv, "--ta-scaling-factor", "0.3", "--output", str(root / "ta")]) == 0
    surgery = ["-q", "calibrate", "--method", "surgery", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    assert main([*surgery, *STEPS, "--evaluate", "--merged", str(root / "ta"), "--output", str(root / "sg")]) == 0
    return root


def test_calibrate_writes_the_modules_the_recipe_and_the_report(clip) -> None:
    folder = clip / "sg"
    assert sorted(p.name for p in folder.iterdir()) == ["featcal_recipe.json", MODULES_FILE, REPORT_FILE]
    modules = load_file(folder / MODULES_FILE)
    assert {k: tuple(v.shape) for k, v in modules.items()} == {
        **{f"t{i}.down": (16, 64) for i in range(3)}, **{f"t{i}.up": (64, 16) for i in range(3)},
    }  # fmt: skip
    recipe = json.loads((folder / "featcal_recipe.json").read_text())
    (entry,) = recipe["repairs"]
    assert recipe["kind"] == "repair" and entry["method"] == "surgery"
    assert {k: entry["params"][k] for k in ("rank", "steps", "learning_rate", "batch_size")} == {
        "rank": 16, "steps": GOLDEN["steps"], "learning_rate": 1e-3, "batch_size": GOLDEN["batch_size"],
    }  # fmt: skip
    draw = entry["params"]["calibration"]
    assert (draw["num_calibration_examples"], draw["calibration_batch_size"], draw["seed"]) == (8, 4, 42)
    assert recipe["merge"] == json.loads((clip / "ta" / "featcal_recipe.json").read_text())["merge"]
    report = json.loads((folder / REPORT_FILE).read_text())
    # featcal's TA merge is FusionBench's bit for bit, so the curve's ends are the golden's
    assert report["loss_first_step"] == pytest.approx(GOLDEN["losses"][0], rel=1e-5)
    assert report["loss_last_step"] == pytest.approx(GOLDEN["losses"][-1], rel=1e-5)
    assert report["seconds"] > 0 and report["peak_host_rss_gib"] > 0
    assert sorted(report["accuracy"]) == ["t0", "t1", "t2"]
    for row in report["accuracy"].values():
        assert set(row) == {"accuracy", "loss", "accuracy_without", "loss_without"}
        assert row["loss"] != row["loss_without"]  # the modules were applied


def test_evaluation_applies_each_task_s_module_to_its_embeddings(clip) -> None:
    """Modules that map z to −z (D = [I; −I], U = [2I, −2I]: U ReLU(D z) = 2z) turn every prediction into
    the least likely class: the evaluation equals negated embeddings, and no image right without them is
    right with them."""
    family = get_family("clip_vision")
    base = family.checkpoint(F / "base")
    merged = family.load_model(clip / "ta", base)
    evaluator = ZeroShotEvaluator(F / "base", "cpu")
    table = task_table(str(clip / "tasks.json"), replace=True)
    tasks = table.select(["t0", "t1"])
    evaluator.prepare(tasks)
    images = evaluator.test_data(tasks, batch_size=4, num_workers=0, max_samples=None)
    eye = torch.eye(64)
    flip = {"t0.down": torch.cat([eye, -eye]), "t0.up": torch.cat([2 * eye, -2 * eye], 1)}
    flip |= {"t1.down": torch.zeros(16, 64), "t1.up": torch.zeros(64, 16)}  # a module that does nothing
    classifier = evaluator.classifier
    plain = classifier.evaluate_task(merged, tasks[0], images=images, progress=False)
    flipped = classifier.evaluate_task(
        merged, tasks[0], images=images, progress=False, features=SurgeryFeatures(flip, "t0", classifier.device)
    )
    negated = classifier.evaluate_task(merged, tasks[0], images=images, progress=False, features=lambda z: -z)
    assert flipped.accuracy == negated.accuracy and flipped.loss == pytest.approx(negated.loss, rel=1e-6)
    assert flipped.loss != pytest.approx(plain.loss) and flipped.accuracy + plain.accuracy <= 1
    zero = SurgeryFeatures(flip, "t1", classifier.device)
    kept = classifier.evaluate_task(merged, tasks[1], images=images, progress=False, features=zero)
    assert kept == classifier.evaluate_task(merged, tasks[1], images=images, progress=False)


# --- refusals -----------------------------------------------------------------------------------------


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", [["export"], ["push", "--repo", "someone/tiny-surgery", "--dry-run"]])
def test_export_and_push_of_a_surgery_output_are_refused_in_one_line(clip, tmp_path, capsys, command) -> None:
    folder = tmp_path / "sg"
    shutil.copytree(clip / "sg", folder)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_error(capsys, [command[0], str(folder), *command[1:]])
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"featcal: error: {folder} holds a Representation Surgery result: per-task modules on top of the merge's "
        "representation, not a transformers model; it is evaluated, not exported or pushed."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no release folder


def test_surgery_without_calibration_data_is_refused_before_any_work(clip, tmp_path, capsys) -> None:
    root = tmp_path / "w"
    table = json.loads((clip / "tasks.json").read_text())
    shutil.copytree(F / "data" / "t1", root / "t1")
    for parquet in (root / "t1" / "data").glob("train-*"):
        parquet.unlink()
    table["tasks"]["t1"]["dataset"]["path"] = str(root / "t1")
    (root / "tasks.json").write_text(json.dumps(table))
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "surgery", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out)])
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: "), err
    assert "t1" in err[0] and "train" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lambda-ratio", "0.5"], "--lambda-ratio '0.5' is invalid: it must be given only with --method featcal: "
         "surgery reads FeatCal's calibration draw (--num-calibration-examples, --seed) but none of its parameters."),
        (["--repair-param", "alpha=0.1"], "Unknown parameter of repair 'surgery' ['alpha']"),
        (["--repair-param", "rank=0"], "rank"),
    ],
)  # fmt: skip
def test_surgery_refuses_what_it_would_not_read_before_any_work(clip, tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "surgery", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out), *extra])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_evaluate_with_another_repair_is_refused(clip, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, err = run_error(capsys, ["calibrate", "--method", "svc", "--evaluate", "--merged", str(clip / "ta"),
                                   "--output", str(out)])  # fmt: skip
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        "featcal: error: --evaluate True is invalid: it must be given only with --method surgery or probsurgery, "
        "whose result is no model folder: evaluate a repaired model folder with `featcal evaluate --model DIR`."
    )
    assert not out.exists()


def llama_data(tmp_path: Path) -> dict:
    """A tiny Llama base and two experts, with their texts: the ``--data`` file's content."""
    base = save_model(tmp_path / "base", seed=0)
    tokenizer().save_pretrained(tmp_path / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(("math", "coding")):
        expert = tmp_path / f"Llama-tiny_{name}"
        save_model(expert, seed=10 + i, base=base)
        tokenizer().save_pretrained(expert)
        words = texts(20 + i, 40)
        rows = "".join(json.dumps({"query": words[2 * j], "response": words[2 * j + 1]}) + "\n" for j in range(20))
        (tmp_path / f"{name}.jsonl").write_text(rows)
        data["experts"][str(expert)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    return data


def t5_data(tmp_path: Path) -> dict:
    """A tiny T5 base and two experts, with their examples: the ``--data`` file's content."""
    from tests.support import tiny_t5

    base = tiny_t5.save_model(tmp_path / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(("sst", "nli")):
        tiny_t5.save_model(tmp_path / f"t5-tiny_glue-{name}", seed=10 + i, base=base)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(tiny_t5.pairs(20 + i))]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(tmp_path / f"t5-tiny_glue-{name}")] = {
            "dataset": f"{name}.jsonl", "input": "classify: {sentence}", "target": "{label}", "labels": ["w1", "w2"],
        }  # fmt: skip
    return data


@pytest.mark.parametrize(("family", "build"), [("causal_lm", llama_data), ("seq2seq", t5_data)])
def test_surgery_on_a_language_model_merge_is_refused_in_one_line_before_any_work(
    tmp_path, capsys, family, build
) -> None:
    (tmp_path / "data.yaml").write_text(json.dumps(build(tmp_path)))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base"), "--output", str(tmp_path / "ta")]
    assert main(merge) == 0
    out = tmp_path / "out"
    code, err = run_error(capsys, ["calibrate", "--method", "surgery", *common, "--merged", str(tmp_path / "ta"),
                                   "--output", str(out)])  # fmt: skip
    assert code == 2 and len(err) == 1, err
    assert "--method 'surgery' is invalid: it must be a repair defined for " in err[0]
    assert f"(family {family}; `featcal methods` lists the repairs): surgery trains its modules on a CLIP" in err[0]
    assert not out.exists()


def test_featcal_methods_lists_surgery_as_needing_data_and_not_releasable(capsys) -> None:
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("\nsurgery ") :].split("\nsvc ")[0]
    assert "Representation Surgery  https://arxiv.org/abs/2402.02705" in block
    assert "needs calibration data: yes" in block and "releasable: no" in block
    assert "rank" in block and "steps" in block
