"""The model card: Hub metadata that parses back to the run's numbers, the body's tables, the plot."""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import shutil

import pytest
from huggingface_hub import ModelCard

from featcal.cli.release import register
from featcal.errors import FeatcalError
from featcal.release import export_release, read_run, render_card, write_card
from tests.support.release_runs import CALIBRATED_ACC, make_run, make_ta8_run

REPO = "yanggangu/clip-vit-base-patch32-ta8-featcal"


@pytest.fixture(scope="module")
def ta8(tmp_path_factory):
    run = make_ta8_run(tmp_path_factory.mktemp("card"))
    return read_run(run)


@pytest.fixture(scope="module")
def ta8_card(ta8) -> ModelCard:
    return ModelCard(str(render_card(ta8, repo_id=REPO)))  # through text, as the Hub reads it


def table_row(card: ModelCard, first_cell: str, section: str = "") -> list[str]:
    """The cells of the first table row starting with ``first_cell`` (after the heading ``section``)."""
    text = card.text.split(f"\n## {section}\n", 1)[1] if section else card.text
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r}")


def test_metadata_names_base_experts_datasets_and_relation(ta8, ta8_card):
    data = ta8_card.data
    assert data.library_name == "transformers"
    assert data.license == "mit"
    assert data.pipeline_tag == "image-feature-extraction"  # what the Hub tags CLIP vision towers
    assert data.base_model == ["openai/clip-vit-base-patch32", *(ta8.experts[t.name] for t in ta8.tasks)]
    assert data.base_model_relation == "merge"
    assert {"merge", "featcal", "model-merging", "clip"} <= set(data.tags)
    assert data.datasets == [t.dataset.path for t in ta8.tasks]
    assert "ylecun/mnist" in data.datasets and "ufldl-stanford/svhn" in data.datasets


def test_model_index_converts_back_to_the_released_accuracies(ta8, ta8_card):
    results = ta8_card.data.eval_results
    assert ta8_card.data.model_name == REPO
    assert [r.dataset_name for r in results] == [t.name for t in ta8.tasks]
    assert {r.dataset_name: r.metric_value for r in results} == {
        t.name: ta8.calibrated.metrics[t.name]["accuracy"] for t in ta8.tasks
    }
    for result, task in zip(results, ta8.tasks):
        assert (result.task_type, result.metric_type) == ("image-classification", "accuracy")
        assert (result.dataset_type, result.dataset_split, result.dataset_config) == (
            task.dataset.path,
            task.dataset.test_split,
            task.dataset.name,
        )
    assert next(r for r in results if r.dataset_name == "svhn").dataset_config == "cropped_digits"


def test_results_table_has_merged_calibrated_and_reference_columns(ta8_card):
    assert table_row(ta8_card, "Task", "Results") == ["Task", "Task Arithmetic", "+ FeatCal", "Published reference"]
    assert table_row(ta8_card, "sun397", "Results") == ["sun397", "57.01", "**70.07**", "57.01 → 70.07"]
    # the average of the published per-task numbers is the published TA8 average (67.55 → 85.47)
    assert table_row(ta8_card, "**average**", "Results") == ["**average**", "67.55", "**85.47**", "67.55 → 85.47"]


def test_recipe_lists_every_hyper_parameter(ta8, ta8_card):
    assert "| task_arithmetic.scaling_factor | `0.3` |" in ta8_card.text
    for name, value in ta8.record.featcal.to_json().items():
        assert f"featcal.{name}" in ta8_card.text and f"`{value}`" in ta8_card.text
    assert "| seed | `42` |" in ta8_card.text
    assert ta8.recipe_sha256 in ta8_card.text


def test_body_has_usage_runtime_and_citation(ta8_card):
    text = ta8_card.text
    assert f'repo_id = "{REPO}"' in text and 'base_id = "openai/clip-vit-base-patch32"' in text
    assert 'load_dataset("tanganke/eurosat", split="test", streaming=True)' in text  # fewest classes, Hub data
    assert table_row(ta8_card, "FeatCal calibration") == ["FeatCal calibration", "53.0"]
    assert "eprint        = {2605.13030}" in text and "archivePrefix = {arXiv}" in text


def test_license_is_a_parameter(ta8):
    assert render_card(ta8, license="apache-2.0").data.license == "apache-2.0"


def test_card_without_repo_id_uses_a_placeholder(ta8):
    card = render_card(ta8)
    assert card.data.model_name == "clip-vit-base-patch32-ta-featcal"
    assert 'repo_id = "<namespace>/clip-vit-base-patch32-ta-featcal"' in card.text


def test_the_card_links_each_hub_input_at_the_commit_the_run_read(tmp_path):
    base_commit, mnist_commit, expert_commit = "a" * 40, "b" * 40, "c" * 40
    expert = "tanganke/clip-vit-base-patch32_mnist"
    commits = {
        "models": {"openai/clip-vit-base-patch32@v1.0": base_commit, expert: expert_commit},
        "datasets": {"mnist": mnist_commit},
    }
    run = read_run(make_ta8_run(tmp_path, base_model_id="openai/clip-vit-base-patch32@v1.0", hub_commits=commits))
    assert run.record.hub_commits == commits
    card = ModelCard(str(render_card(run, repo_id=REPO)))
    base_row = " | ".join(table_row(card, "base model", "Recipe"))
    base_url = f"https://huggingface.co/openai/clip-vit-base-patch32/tree/{base_commit}"
    assert f"({base_url}) at `{base_commit[:12]}`" in base_row
    mnist = " | ".join(table_row(card, "mnist", "Recipe"))
    assert f"huggingface.co/datasets/ylecun/mnist/tree/{mnist_commit}" in mnist
    assert f"{expert}/tree/{expert_commit}" in mnist
    svhn = " | ".join(table_row(card, "svhn", "Recipe"))
    assert "/tree/" not in svhn  # no commit recorded for it: its page, unpinned
    assert card.data.base_model[0] == "openai/clip-vit-base-patch32"  # the Hub's relation names the repository
    assert 'base_id = "openai/clip-vit-base-patch32"' in card.text  # the snippet loads the repository


def test_local_refs_stay_out_of_hub_metadata(tmp_path):
    run, _ = make_run(tmp_path)
    card = render_card(read_run(run), repo_id="me/tiny")
    metadata = card.data.to_dict()
    assert not {"base_model", "base_model_relation", "datasets"} & set(metadata)
    assert {r.dataset_name: r.metric_value for r in card.data.eval_results} == CALIBRATED_ACC
    assert {r.dataset_type for r in card.data.eval_results} == {"t0", "t1", "t2"}
    assert table_row(card, "t0", "Results") == ["t0", "20.00", "40.00", "**70.00**"]


def test_bad_repo_id_and_templates_give_featcal_errors(ta8, tmp_path):
    with pytest.raises(FeatcalError, match="not a valid Hub repository id"):
        render_card(ta8, repo_id="no//good")
    with pytest.raises(FeatcalError, match="it needs a namespace"):  # push would refuse it: so does the card
        render_card(ta8, repo_id="tiny-featcal")
    with pytest.raises(FeatcalError, match="does not exist"):
        render_card(ta8, template=tmp_path / "missing.j2")
    broken = tmp_path / "broken.md.j2"
    broken.write_text("---\n{{ card_data }}\n---\n{{ no_such_variable }}\n")
    with pytest.raises(FeatcalError, match="failed to render.*no_such_variable"):
        render_card(ta8, template=broken)
    custom = tmp_path / "custom.md.j2"
    custom.write_text("---\n{{ card_data }}\n---\n# {{ title }}: {{ rows[-1].calibrated | pct }}\n")
    card = render_card(ta8, template=custom, repo_id=REPO)
    assert card.text.strip() == "# clip-vit-base-patch32-ta8-featcal: 85.47"


def test_write_card_writes_the_plot_and_regenerates_only_the_card(tmp_path):
    run, _ = make_run(tmp_path)
    release = export_release(run, repo_id="me/tiny")
    weights = release / "model.safetensors"
    stamp = weights.stat().st_mtime_ns, weights.read_bytes()
    assert (release / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_card(run, repo_id="me/other", license="apache-2.0")
    card = ModelCard.load(release / "README.md")
    assert (card.data.model_name, card.data.license) == ("me/other", "apache-2.0")
    assert "![Zero-shot accuracy per task](results.png)" in card.text
    assert (weights.stat().st_mtime_ns, weights.read_bytes()) == stamp


def test_without_matplotlib_the_card_has_no_image(tmp_path, monkeypatch, caplog, ta8):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level(logging.WARNING, logger="featcal.release.plot"):
        card_path = write_card(ta8.path, tmp_path / "out", repo_id=REPO)
    assert "matplotlib is not installed" in caplog.text
    assert not (tmp_path / "out" / "results.png").exists()
    assert "results.png" not in card_path.read_text()


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="featcal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_export_and_card(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    out = str(tmp_path / "rel")
    assert cli("export", str(run), "--output", out, "--repo", "me/tiny", "--license", "cc-by-4.0") == 0
    assert capsys.readouterr().out.strip() == f"Release folder: {tmp_path / 'rel'}"
    assert ModelCard.load(tmp_path / "rel" / "README.md").data.license == "cc-by-4.0"
    assert cli("card", str(run), "--output", str(tmp_path / "rel"), "--repo", "me/renamed") == 0
    assert capsys.readouterr().out.strip() == f"Model card: {tmp_path / 'rel' / 'README.md'}"
    assert ModelCard.load(tmp_path / "rel" / "README.md").data.model_name == "me/renamed"
    assert json.loads((tmp_path / "rel" / "metrics.json").read_text())["t0"]["accuracy"] == CALIBRATED_ACC["t0"]


def test_merged_only_card_compares_with_the_merged_reference_only(tmp_path):
    run = make_ta8_run(tmp_path)
    shutil.rmtree(run / "featcal-ta")
    card = render_card(read_run(run), repo_id="me/ta8-merged")
    assert table_row(card, "Task", "Results") == ["Task", "Task Arithmetic", "Published reference"]
    assert table_row(card, "sun397", "Results") == ["sun397", "57.01", "57.01"]
    assert card.data.model_name == "me/ta8-merged" and "2. **Evaluate.**" in card.text
    assert {r.dataset_name: r.metric_value for r in card.data.eval_results}["sun397"] == 0.570125937461853


def test_expert_column_subset_evaluation_and_stage_timings(tmp_path):
    run, _ = make_run(tmp_path, base_dir="base", with_experts=True, max_eval_samples=10)
    card = render_card(read_run(run), repo_id="me/tiny")
    header = ["Task", "Zero-shot base", "Task expert", "Task Arithmetic", "+ FeatCal"]
    assert table_row(card, "Task", "Results") == header
    assert table_row(card, "t1", "Results") == ["t1", "10.00", "95.00", "50.00", "**80.00**"]
    assert table_row(card, "**average**", "Results") == ["**average**", "20.00", "90.00", "40.00", "**70.00**"]
    assert "(its first 10 images)" in card.text
    assert {r.dataset_split for r in card.data.eval_results} == {"test[:10]"}
    assert table_row(card, "evaluation of `featcal-ta/`", "Runtime") == ["evaluation of `featcal-ta/`", "1.0"]


def test_a_recipe_edited_after_the_run_is_refused(tmp_path):
    run, info = make_run(tmp_path)
    (run / "run_config.json").write_text(json.dumps({**info["config"], "seed": 0}))
    with pytest.raises(FeatcalError, match="was edited after the run"):
        read_run(run)


def test_a_data_using_merge_s_card_names_its_draw(tmp_path):
    calibration = {"num_calibration_examples": 256, "calibration_batch_size": 16, "seed": 7}
    used = {"svhn": 200, "dtd": 100}
    merge = {"method": "regmean", "params": {"reduce_non_diagonal_ratio": 0.95, "exclude_param_names_regex": ""}}
    card = render_card(read_run(make_ta8_run(tmp_path, merge={**merge, "calibration": calibration})))
    assert "one vision tower, from the\n   features of a few training images per task" in card.text
    assert "the very images FeatCal\n   reads next" in card.text
    assert table_row(card, "regmean.exclude_param_names_regex", "Recipe")[1] == "empty"
    assert table_row(card, "merge data", "Recipe")[1] == (
        "the first `256` training images of each task after the shuffle with seed `7`, in batches of `16`"
    )
    merge["calibration"] = {**calibration, "calibration_examples_used": used}
    card = render_card(read_run(make_ta8_run(tmp_path / "fewer", merge=merge)))
    assert table_row(card, "merge data", "Recipe")[1].endswith(
        "in batches of `16` (all of them where a train split holds fewer: dtd: 100, svhn: 200)"
    )


def test_a_data_free_merge_s_card_has_no_merge_data(ta8_card):
    assert "merge data" not in ta8_card.text and "features of a few training images" not in ta8_card.text


def test_an_extra_card_section_follows_the_template_and_one_with_nothing_to_say_changes_nothing(ta8, monkeypatch):
    from featcal.release import run_card

    plain = str(render_card(ta8, repo_id=REPO))
    monkeypatch.setattr(run_card, "CARD_SECTIONS", [lambda run: None])
    assert str(render_card(ta8, repo_id=REPO)) == plain
    section = "\n## Comparison\n\n| repair | average |\n|---|---|\n| featcal | 70.00 |\n"
    monkeypatch.setattr(run_card, "CARD_SECTIONS", [lambda run: None, lambda run: section if run is ta8 else ""])
    card = str(render_card(ta8, repo_id=REPO))
    assert card == plain + section
    assert ModelCard(card).data.model_name == REPO  # the metadata still parses
