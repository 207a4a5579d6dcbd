"""The built-in suites and backbones: their tables, options, listing and run records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.utils import validate_repo_id

from featcal.cli import main
from featcal.errors import InvalidParameterError, UnknownNameError
from featcal.families.clip_vision.entries import image_classes
from featcal.spec import RunSpec, build_spec
from featcal.suites import (
    BACKBONE_NAMES,
    SUITE_NAMES,
    backbone,
    describe_suite,
    featcal_settings_source,
    merged_reference,
    suite_backbones,
    suite_names,
    suite_table,
    suite_task_names,
    suites_data,
    task_table,
)
from featcal.tasks import builtin_tasks

RESOURCES = Path(__file__).parents[1] / "featcal" / "resources"
# The number of classes of each task in FusionBench (fusion_bench/tasks/clip_classification/*.py).
FUSIONBENCH_CLASSES = {
    "sun397": 397, "stanford-cars": 196, "resisc45": 45, "eurosat": 10, "svhn": 10, "gtsrb": 43, "mnist": 10,
    "dtd": 47, "oxford_flowers102": 102, "pcam": 2, "fer2013": 7, "oxford-iiit-pet": 37, "stl10": 10,
    "cifar100": 100, "cifar10": 10, "food101": 101, "fashion_mnist": 10, "emnist_letters": 26, "kmnist": 10,
    "rendered-sst2": 2,
}  # fmt: skip
CLIP_SUITES = suite_names("clip_vision")
ALL_PAIRS = [(s, b) for s in CLIP_SUITES for b in suite_backbones(s)]


def test_suites_are_fusionbenchs_8_14_and_20_tasks_each_extending_the_last():
    assert CLIP_SUITES == ("ta8", "ta14", "ta20") and suite_backbones("ta8") == ["b32", "b16", "l14"]
    assert SUITE_NAMES == (*CLIP_SUITES, "mergebench", "glue8") and set(suite_backbones("ta8")) < set(BACKBONE_NAMES)
    ta8, ta14, ta20 = (suite_task_names(s) for s in CLIP_SUITES)
    assert ta8 == list(builtin_tasks().tasks)
    assert ta14 == [*ta8, "oxford_flowers102", "pcam", "fer2013", "oxford-iiit-pet", "stl10", "cifar100"]
    assert ta20 == [*ta14, "cifar10", "food101", "fashion_mnist", "emnist_letters", "kmnist", "rendered-sst2"]
    assert list(FUSIONBENCH_CLASSES) == ta20


@pytest.mark.parametrize("suite, backbone_name", ALL_PAIRS)
def test_every_table_is_well_formed(suite, backbone_name):
    table = suite_table(suite, backbone_name)
    model = backbone(backbone_name)
    assert list(table.tasks) == suite_task_names(suite)
    assert table.base_model == model.base_model
    for name, task in table.tasks.items():
        classes = image_classes(task)
        assert len(classes.classnames) == FUSIONBENCH_CLASSES[name], name
        assert len(set(classes.classnames)) == len(classes.classnames), name
        assert classes.templates and all(t.count("{}") == 1 for t in classes.templates), name
        validate_repo_id(task.dataset.path)
        validate_repo_id(task.expert)
        assert task.expert == model.expert(name)
        assert task.dataset.image_column and task.dataset.label_column
        assert all(0 < v <= 1 for v in task.reference_accuracy.values()), name


@pytest.mark.parametrize("suite, backbone_name", [("ta8", "flan-t5-base"), ("ta20", "flan-t5-base"), ("glue8", "b32")])
def test_a_suite_runs_on_its_own_backbones_only(suite, backbone_name):
    with pytest.raises(UnknownNameError, match=f"Suite {suite}: unknown backbone '{backbone_name}'"):
        suite_table(suite, backbone_name)


def test_backbones_name_the_real_base_and_expert_ids():
    assert backbone("b16").base_model == "openai/clip-vit-base-patch16"
    assert backbone("l14").expert("pcam") == "tanganke/clip-vit-large-patch14_pcam"
    with pytest.raises(UnknownNameError, match="known: b32, b16, l14"):
        backbone("h14")
    with pytest.raises(UnknownNameError, match="known: ta8, ta14, ta20"):
        suite_table("ta30")


def test_the_default_is_the_shipped_ta8_table_unchanged():
    assert suite_table().tasks == builtin_tasks().tasks == task_table().tasks
    assert suite_table("ta8", "b32") == builtin_tasks()
    for task in builtin_tasks().tasks.values():
        assert "reference_source" not in task.to_dict()  # recorded exactly as before suites existed


def test_each_task_is_described_once():
    ta8 = json.loads((RESOURCES / "ta8_tasks.json").read_text())["tasks"]
    tall = json.loads((RESOURCES / "tall_tasks.json").read_text())["tasks"]
    assert not set(ta8) & set(tall)
    assert set(ta8) | set(tall) == set(FUSIONBENCH_CLASSES)


def test_real_splits_columns_and_labels_that_differ_from_the_usual():
    table = suite_table("ta20", "b32")
    assert table.tasks["food101"].dataset.test_split == "validation"
    assert (table.tasks["fer2013"].dataset.image_column, table.tasks["fer2013"].dataset.label_column) == ("jpg", "cls")
    letters = image_classes(table.tasks["emnist_letters"]).classnames
    assert letters[0] == "A" and letters[-1] == "Z"
    assert image_classes(table.tasks["pcam"]).classnames == (
        "lymph node", "lymph node containing metastatic tumor tissue"
    )  # fmt: skip


def test_references_belong_to_the_suite_and_backbone_they_were_published_for():
    # B/32 TA8: the FeatCal reference run's, as shipped
    assert merged_reference("ta8", "b32")["task_arithmetic_featcal"]["average"] == pytest.approx(0.8547, abs=1e-4)
    # B/16 and L/14 TA8: FusionBench's, whose published average is the mean of its per-task numbers
    for name in ("b16", "l14"):
        published = merged_reference("ta8", name)
        assert set(published) == {"simple_average", "task_arithmetic", "ties"}
        for values in published.values():
            per_task = [v for k, v in values.items() if k != "average"]
            assert len(per_task) == 8 and sum(per_task) / 8 == pytest.approx(values["average"], abs=6e-4)
    assert merged_reference("ta8", "b16")["task_arithmetic"]["average"] == pytest.approx(0.771)
    table = suite_table("ta8", "l14")
    assert table.tasks["dtd"].reference_accuracy["ties"] == pytest.approx(0.639)
    assert "FusionBench" in table.tasks["dtd"].reference_source and "ViT-L/14" in table.tasks["dtd"].reference_source
    # the TA8 merge numbers are not those of a 14-task merge: none are carried over
    for name in suite_backbones("ta14"):
        assert not any(t.reference_accuracy for t in suite_table("ta14", name).tasks.values())
    single = suites_data()["reference_accuracy"]["single_model"]
    assert set(single) == {*suite_backbones("ta8"), "flan-t5-base"}  # FLAN-T5's: tests/test_seq2seq_run.py
    for name in suite_backbones("ta8"):
        assert all(set(values) == set(FUSIONBENCH_CLASSES) for values in single[name].values())


def test_suite_and_backbone_are_run_options_with_checked_values(tmp_path):
    spec = build_spec(cli={"suite": "ta14", "backbone": "l14"})
    assert (spec.suite, spec.backbone) == ("ta14", "l14")
    assert (RunSpec().suite, RunSpec().backbone) == ("ta8", "b32")
    with pytest.raises(InvalidParameterError, match="one of ta8, ta14, ta20"):
        RunSpec(suite="ta9")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("suite: ta20\nbackbone: b16\n")
    from featcal.spec import load_recipe

    assert build_spec(recipe=load_recipe(recipe)).backbone == "b16"


def test_a_bad_suite_on_the_command_line_is_one_error_line(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--backbone", "b64", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("featcal: error:") and "b32, b16, l14" in err[0]
    assert not out.exists()


def test_the_default_run_folder_is_named_after_backbone_and_suite():
    assert RunSpec().output_dir == "outputs/clip-vit-b32-ta8"
    assert RunSpec(suite="ta14", backbone="b16").output_dir == "outputs/clip-vit-b16-ta14"
    assert build_spec(cli={"suite": "ta20", "output_dir": "runs/mine"}).output_dir == "runs/mine"


def test_the_record_names_suite_and_backbone_only_when_chosen():
    from featcal.runfolder.recording import suite_record

    assert suite_record(RunSpec()) == {}
    assert suite_record(RunSpec(suite="ta8", backbone="b32")) == {}
    assert suite_record(RunSpec(suite="ta20")) == {"suite": "ta20"}
    assert suite_record(RunSpec(backbone="l14")) == {"backbone": "l14"}


def test_explicit_models_still_win_over_the_backbone():
    from featcal.resolve import expert_ref

    table = task_table(suite="ta14", backbone="b16")
    assert expert_ref(table.tasks["pcam"], "/my/experts/{task}", table.expert_model_pattern) == "/my/experts/pcam"
    assert expert_ref(table.tasks["pcam"], None, None) == "tanganke/clip-vit-base-patch16_pcam"


def test_a_tasks_file_extends_the_chosen_suite(tmp_path):
    entry = "    dataset: me/mine\n    classnames: [a, b]\n    templates: ['{}']\n"
    (tmp_path / "t.yaml").write_text(f"tasks:\n  mine:\n{entry}")
    table = task_table(tmp_path / "t.yaml", suite="ta14", backbone="b16")
    assert list(table.tasks)[-2:] == ["cifar100", "mine"] and table.base_model == "openai/clip-vit-base-patch16"


def test_featcal_tasks_lists_a_suite(capsys):
    assert main(["tasks", "--suite", "ta20", "--backbone", "l14"]) == 0
    out = capsys.readouterr().out
    assert "20 tasks, on CLIP ViT-L/14" in out and "ethz/food101" in out and "validation" in out
    assert "No per-task merge accuracy is published" in out
    assert main(["tasks", "--backbone", "b16", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing == describe_suite("ta8", "b16")
    sun = listing["tasks"][0]
    assert sun["name"] == "sun397" and sun["classes"] == 397 and sun["templates"] == 2
    assert sun["reference_accuracy"]["expert"] == pytest.approx(0.7892)
    assert sun["reference_accuracy"]["task_arithmetic"] == pytest.approx(0.659)
    assert listing["reference_average"]["ties"] == pytest.approx(0.775)


def test_featcal_tasks_imports_no_torch():
    code = "import sys; from featcal.cli import main; main(['tasks', '--suite', 'ta20']); "
    code += "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; assert not heavy, heavy"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _suite_run(root: Path, suite: str, backbone_name: str) -> Path:
    """A run folder of ``suite`` on ``backbone_name`` as `featcal run` records it (metrics only, no weights)."""
    from tests.support.release_runs import FEATCAL, metrics, with_run_id

    table = suite_table(suite, backbone_name)
    config = with_run_id(
        {
            "featcal_version": "0.1.0",
            "base_model_id": table.base_model,
            "experts": {name: task.expert for name, task in table.tasks.items()},
            "tasks": list(table.tasks),
            "suite": suite,
            "backbone": backbone_name,
            "tasks_table": {name: task.to_dict() for name, task in table.tasks.items()},
            "merge": {"method": "task_arithmetic", "params": {"scaling_factor": 0.3}},
            "featcal": FEATCAL,
            "seed": 42,
            "evaluation": {"max_eval_samples": None},
        }
    )
    run = root / f"{suite}-{backbone_name}"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps(config))
    for stage, accuracy in (("ta", 0.5), ("featcal-ta", 0.75)):
        (run / stage).mkdir()
        accuracies = {name: accuracy for name in table.tasks}
        (run / stage / "metrics.json").write_text(json.dumps(metrics(accuracies, config["run_id"])))
    return run


def test_the_card_shows_the_references_published_for_the_runs_suite_and_backbone(tmp_path):
    from featcal.release import read_run, render_card

    card = str(render_card(read_run(_suite_run(tmp_path, "ta8", "l14"))))
    assert "| dtd | 50.00 | **75.00** | 58.80 |" in card  # FusionBench's L/14 TA8 Task Arithmetic on DTD
    assert "published by FusionBench (docs/modelpool/clip_vit.md, CLIP ViT-L/14, 8 tasks)" in card
    assert "FeatCal reference run" not in card
    card = str(render_card(read_run(_suite_run(tmp_path, "ta20", "b32"))))
    assert "| rendered-sst2 | 50.00 | **75.00** |" in card and "Published reference" not in card


def test_the_space_offers_the_chosen_suite_else_the_models_own(tmp_path):
    from featcal.space.model import space_tasks
    from featcal.space.settings import SpaceSettings

    assert [t.name for t in space_tasks(SpaceSettings())] == suite_task_names("ta8")
    assert [t.name for t in space_tasks(SpaceSettings(), "ta20")] == suite_task_names("ta20")
    assert [t.name for t in space_tasks(SpaceSettings(suite="ta14"), "ta20")] == suite_task_names("ta14")
    assert "suite" not in SpaceSettings().to_config()  # a Space staged without one is as before
    assert SpaceSettings(suite="ta14").to_config()["suite"] == "ta14"
    assert SpaceSettings.from_app_dir(tmp_path, {"SUITE": "ta20"}).suite == "ta20"
    with pytest.raises(UnknownNameError, match="suite 'ta9'"):
        space_tasks(SpaceSettings(suite="ta9"))


def test_featcal_methods_shows_the_averages_published_for_the_suite(capsys):
    assert main(["methods", "--backbone", "l14"]) == 0
    out = capsys.readouterr().out
    assert "published average on ta8/l14: 80.70" in out and "published average on ta8/l14: 84.00" in out
    assert "CLIP ViT-L/14, 8 tasks" in out
    assert main(["methods"]) == 0
    assert "published average with FeatCal on ta8/b32: 85.47" in capsys.readouterr().out
    assert main(["methods", "--suite", "ta14", "--backbone", "b16"]) == 0
    out = capsys.readouterr().out
    assert "published average" not in out and "No merge accuracy is published for ta14 on b16." in out


# MergeBench's formatting_prompts_func (merging/taskloader.py at b245648) of a row without input: its f-string's
# eight-space indents and trailing newline are part of the text.
MERGEBENCH_TEXT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n        \n        ### Instruction:\n        {q}\n        "
    "\n        ### Response:\n        {r}\n        "
)
MERGEBENCH_POOLS = {  # FusionBench config/modelpool/CausalLMPool/mergebench/*.yaml
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "MergeBench/Llama-3.2-3B_{task}"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "MergeBench/Llama-3.1-8B_{task}"),
    "gemma-2-2b": ("google/gemma-2-2b", "MergeBench/gemma-2-2b_{task}"),
    "gemma-2-9b": ("google/gemma-2-9b", "MergeBench/gemma-2-9b_{task}"),
}


def test_mergebench_is_merge_bench_s_tasks_data_prompt_and_models():
    from featcal.families.causal_lm.texts import render_text

    assert suite_backbones("mergebench") == list(MERGEBENCH_POOLS)
    columns = {"instruction": ("instruction", "output"), "math": ("query", "response"),
               "coding": ("instruction", "response"), "multilingual": ("inputs", "targets"),
               "safety": ("prompt", "response")}  # fmt: skip
    for name, (base, pattern) in MERGEBENCH_POOLS.items():
        table = suite_table("mergebench", name)
        assert table.base_model == base and list(table.tasks) == list(columns)
        assert table.merge_defaults == {"task_arithmetic": {"scaling_factor": 0.4, "keep_embeddings": True}}
        for task, (question, answer) in columns.items():
            entry = table.tasks[task]
            assert entry.family == "causal_lm" and entry.expert == pattern.format(task=task)
            assert (entry.dataset.path, entry.dataset.train_split) == (f"MergeBench/{task}_val", "train")
            prompt, response = render_text(entry, {question: "Q?", answer: "A."})
            assert prompt + response == MERGEBENCH_TEXT.format(q="Q?", r="A.")
            assert entry.text.answer == ("boxed" if task == "math" else None)
            assert (entry.text.weigh, entry.text.max_length) == ("all", 2048)
    assert merged_reference("mergebench", "llama-3.2-3b") == {
        "task_arithmetic": {"average": 0.601},
        "task_arithmetic_featcal": {"average": 0.621},
    }
    assert merged_reference("mergebench", "llama-3.1-8b")["task_arithmetic_featcal"] == {"average": 0.658}
    assert merged_reference("mergebench", "gemma-2-2b") == {}


def test_a_suite_s_backbone_is_its_own_and_chooses_the_run_folder(capsys):
    spec = RunSpec(suite="mergebench")
    assert spec.backbone == "llama-3.2-3b" and spec.output_dir == "outputs/llama-3.2-3b-mergebench"
    assert RunSpec().backbone == "b32" and RunSpec().output_dir == "outputs/clip-vit-b32-ta8"
    with pytest.raises(InvalidParameterError, match="one of mergebench's: llama-3.2-3b"):
        RunSpec(suite="mergebench", backbone="l14")
    with pytest.raises(UnknownNameError, match="unknown backbone 'gemma-2-2b'"):
        suite_table("ta8", "gemma-2-2b")
    assert main(["tasks", "--suite", "mergebench", "--backbone", "gemma-2-9b"]) == 0
    out = capsys.readouterr().out
    assert "MergeBench/gemma-2-9b_math" in out and "boxed" in out and "gsm8k_cot" in out
    assert "Not run by featcal (coding)" in out and "No reference average is quoted" in out
    assert main(["tasks", "--suite", "mergebench", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["family"] == "causal_lm" and listing["reference_average"]["task_arithmetic_featcal"] == 0.621
    # FeatCal's defaults are CLIP's reference values, and a language suite says so; a CLIP suite has its own
    assert "CLIP ViT-B/32 reference run" in listing["featcal_settings"]
    assert featcal_settings_source("mergebench") == listing["featcal_settings"]
    assert featcal_settings_source("ta14") is None


def test_a_suite_s_merge_settings_are_the_defaults_under_the_spec_s(monkeypatch):
    from featcal import resolve

    calls = []
    monkeypatch.setattr(resolve, "resolve_models", lambda *a, **k: calls.append(a) or ("base", None, {}))
    inputs = resolve.resolve_inputs(RunSpec(suite="mergebench"))
    assert inputs.merge_params == {"scaling_factor": 0.4, "keep_embeddings": True}
    assert calls[0][2] == "meta-llama/Llama-3.2-3B"
    mine = resolve.resolve_inputs(RunSpec(suite="mergebench", ta_scaling_factor=0.3))
    assert mine.merge_params == {"scaling_factor": 0.3, "keep_embeddings": True}
    assert resolve.resolve_inputs(RunSpec()).merge_params == {"scaling_factor": 0.3}


def test_the_space_names_the_clip_suites_for_a_suite_of_other_tasks():
    from featcal.space.model import space_tasks
    from featcal.space.settings import SpaceSettings

    with pytest.raises(UnknownNameError, match="Unknown CLIP suite 'glue8'; known: ta8, ta14, ta20"):
        space_tasks(SpaceSettings(suite="glue8"))
    with pytest.raises(UnknownNameError, match="CLIP suite 'glue8'"):  # a Space whose model's run recorded glue8
        space_tasks(SpaceSettings(), "glue8")
