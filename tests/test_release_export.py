"""The release folder: weights that load and match the in-memory model, metadata, atomicity, checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal import __version__
from featcal.cli import main
from featcal.errors import FeatcalError
from featcal.release import check_release, export_release, read_run
from featcal.release import export as export_module
from featcal.release.manifest import tensors_sha256
from featcal.release.published import published_config
from featcal.runfolder.record import recipe_sha256
from tests.support.release_runs import CALIBRATED_ACC, FIXTURE, MERGED_ACC, make_run


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run, info = make_run(tmp_path_factory.mktemp("export"))
    return run, export_release(run, repo_id="me/tiny-featcal"), info


def test_release_folder_holds_exactly_the_release_files(exported):
    run, release, _ = exported
    assert release == run / "release"
    assert sorted(p.name for p in release.iterdir()) == [
        "README.md",
        "config.json",
        "metrics.json",
        "model.safetensors",
        "preprocessor_config.json",
        "release_manifest.json",
        "results.png",
        "run_config.json",
    ]
    # the recipe as published: the run's own, with its local inputs named by folder (same run_id)
    published = json.loads((release / "run_config.json").read_text())
    assert published == published_config(json.loads((run / "run_config.json").read_text()))
    assert published["run_id"] == read_run(run).recipe_sha256
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_weights_load_and_match_the_calibrated_model_in_memory(exported):
    _, release, info = exported
    loaded = CLIPVisionModel.from_pretrained(str(release)).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = info["model"](pixel_values=pixels)
        actual = loaded(pixel_values=pixels)
    assert torch.equal(actual.pooler_output, expected.pooler_output)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)
    # and it is the calibrated stage, not the merged baseline
    merged = CLIPVisionModel.from_pretrained(str(release.parent / "ta")).eval()
    with torch.no_grad():
        assert not torch.equal(merged(pixel_values=pixels).pooler_output, actual.pooler_output)


def test_safetensors_metadata_names_featcal_and_the_recipe(exported):
    _, release, info = exported
    with safe_open(str(release / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        keys = list(f.keys())
    published = json.loads((release / "run_config.json").read_text())
    assert metadata == {
        "format": "pt",
        "featcal_version": __version__,
        "recipe_sha256": info["run_id"],
        "tensors_sha256": tensors_sha256(release / "model.safetensors"),
        "published_config_sha256": recipe_sha256(published),
    }
    assert keys and all(k.startswith("vision_model.") for k in keys)


def test_metrics_and_processor(exported):
    _, release, info = exported
    metrics = json.loads((release / "metrics.json").read_text())
    assert metrics["run_id"] == info["run_id"]
    assert {t: metrics[t]["accuracy"] for t in CALIBRATED_ACC} == CALIBRATED_ACC
    processor = CLIPImageProcessor.from_pretrained(str(release))
    assert processor.crop_size["height"] == 32


def test_check_release_accepts_the_export(exported):
    _, release, info = exported
    checked = check_release(release)
    assert checked.recipe_sha256 == info["run_id"]
    assert checked.model_name == "me/tiny-featcal"
    assert {f.path_in_repo for f in checked.files} == {p.name for p in release.iterdir()}


def test_usage_snippet_in_the_card_runs(exported, capsys, tmp_path):
    _, release, _ = exported
    card = ModelCard.load(release / "README.md")
    snippet = card.text.split("```python\n")[1].split("```")[0]
    # the run's inputs are local folders: the snippet names the base by its folder name and opens an
    # image file (no local dataset path); point both at the fixture's to run it
    image = pq.read_table(FIXTURE / "data" / "t0" / "data" / "test-00000-of-00001.parquet")["image"][0]
    (tmp_path / "image.png").write_bytes(image.as_py()["bytes"])
    for placeholder, value in [
        ('"me/tiny-featcal"', str(release)),
        ('"base"', str(FIXTURE / "base")),
        ('"path/to/image.png"', str(tmp_path / "image.png")),
    ]:
        assert placeholder in snippet
        snippet = snippet.replace(placeholder, repr(value))
    exec(compile(snippet, "card-snippet", "exec"), {})
    label, probability = capsys.readouterr().out.split()
    assert label.startswith("thing0x") and 0.0 < float(probability) <= 1.0


def test_the_card_s_pipeline_tag_runs_on_the_release(exported):
    """The Hub offers the transformers pipeline the card's ``pipeline_tag`` names: it must load the release."""
    from PIL import Image
    from transformers import pipeline

    _, release, _ = exported
    tag = ModelCard.load(release / "README.md").data.pipeline_tag
    assert tag == "image-feature-extraction"
    features = torch.as_tensor(pipeline(tag, model=str(release))(Image.new("RGB", (40, 30), "red")))
    config = json.loads((release / "config.json").read_text())
    tokens = (config["image_size"] // config["patch_size"]) ** 2 + 1
    assert features.shape == (1, tokens, config["hidden_size"]) and torch.isfinite(features).all()


def test_merged_only_run_releases_the_merged_model(tmp_path):
    run, _ = make_run(tmp_path, calibrated=False, base_dir=None)
    release = export_release(run, tmp_path / "out")
    metrics = json.loads((release / "metrics.json").read_text())
    assert {t: metrics[t]["accuracy"] for t in MERGED_ACC} == MERGED_ACC
    card = ModelCard.load(release / "README.md")
    assert "+ FeatCal" not in card.text and "Zero-shot base" not in card.text
    assert "featcal | not run" in card.text


def test_a_failed_export_leaves_the_previous_release_untouched(exported, monkeypatch):
    run, release, _ = exported
    before = {p.name: p.read_bytes() for p in release.iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "write_card_files", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_release(run, repo_id="me/tiny-featcal")
    assert {p.name: p.read_bytes() for p in release.iterdir()} == before
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_refuses_to_replace_a_folder_that_is_not_a_release(exported, tmp_path):
    run, _, _ = exported
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(FeatcalError, match="not a release.s"):
        export_release(run, tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_metrics_of_another_run_are_refused(tmp_path):
    run, _ = make_run(tmp_path)
    metrics = json.loads((run / "featcal-ta" / "metrics.json").read_text())
    (run / "featcal-ta" / "metrics.json").write_text(json.dumps({**metrics, "run_id": "0123456789abcdef"}))
    with pytest.raises(FeatcalError, match="belongs to another run"):
        read_run(run)


def test_run_folder_errors_name_the_fix(tmp_path):
    with pytest.raises(FeatcalError, match="does not exist"):
        read_run(tmp_path / "nope")
    tmp_path.joinpath("run_config.json").write_text("{not json")
    with pytest.raises(FeatcalError, match="not valid JSON"):
        read_run(tmp_path)
    run, _ = make_run(tmp_path / "x")
    shutil.rmtree(run / "ta")
    shutil.rmtree(run / "featcal-ta")
    with pytest.raises(FeatcalError, match="run the merge"):
        read_run(run)


@pytest.fixture
def release_copy(exported, tmp_path) -> Path:
    return Path(shutil.copytree(exported[1], tmp_path / "release"))


@pytest.mark.parametrize("missing", ["model.safetensors", "README.md", "metrics.json", "run_config.json"])
def test_check_release_refuses_an_incomplete_folder(release_copy, missing):
    (release_copy / missing).unlink()
    with pytest.raises(FeatcalError, match=f"not a complete release: {missing} missing"):
        check_release(release_copy)


def test_check_release_refuses_weights_that_do_not_load(release_copy):
    from safetensors.torch import save_file

    save_file(
        {"vision_model.something.weight": torch.zeros(2)},
        str(release_copy / "model.safetensors"),
        metadata={"recipe_sha256": check_release(release_copy).recipe_sha256},
    )
    with pytest.raises(FeatcalError, match="do not match a CLIPVisionModel"):
        check_release(release_copy)


def test_check_release_refuses_metrics_of_other_weights(release_copy):
    metrics = json.loads((release_copy / "metrics.json").read_text())
    (release_copy / "metrics.json").write_text(json.dumps({**metrics, "run_id": "f" * 64}))
    with pytest.raises(FeatcalError, match="does not describe the weights"):
        check_release(release_copy)


def test_check_release_refuses_a_changed_recipe(release_copy):
    config = json.loads((release_copy / "run_config.json").read_text())
    config["seed"] = 7
    (release_copy / "run_config.json").write_text(json.dumps(config))
    with pytest.raises(FeatcalError, match="is not the recipe of the weights"):
        check_release(release_copy)


def test_check_release_refuses_a_card_with_broken_metadata(release_copy):
    (release_copy / "README.md").write_text("---\nlicense: [unclosed\n---\n# card\n")
    with pytest.raises(FeatcalError, match="invalid metadata"):
        check_release(release_copy)


def test_export_of_a_real_featcal_run(tmp_path, device):
    """The release stage reads what `featcal run` writes (layout drift between the two fails here)."""
    out = tmp_path / "run"
    code = main(
        [
            "-q",
            "run",
            "--tasks-file",
            str(FIXTURE / "tasks.json"),
            "--base-model-id",
            str(FIXTURE / "base"),
            "--output-dir",
            str(out),
            "--num-calibration-examples",
            "8",
            "--calibration-batch-size",
            "4",
            "--eval-num-workers",
            "0",
            "--eval-batch-size",
            "4",
            "--device",
            device,
            "--eval-zero-shot",
        ]
    )
    assert code == 0
    release = export_release(out, repo_id="me/real-run")
    checked = check_release(release)
    run = read_run(out)
    assert checked.recipe_sha256 == run.raw_config["run_id"] == run.recipe_sha256
    assert run.base_metrics is not None and run.calibrated.name == "featcal-ta"
    released = load_file(str(release / "model.safetensors"))
    calibrated = load_file(str(out / "featcal-ta" / "model.safetensors"))
    assert released.keys() == calibrated.keys() and all(torch.equal(released[k], calibrated[k]) for k in released)
    card = ModelCard.load(release / "README.md")
    assert {r.dataset_name: r.metric_value for r in card.data.eval_results} == {
        t: run.calibrated.metrics[t]["accuracy"] for t in ("t0", "t1", "t2")
    }


def test_an_unevaluated_merged_stage_is_left_out_of_the_card(tmp_path):
    run, _ = make_run(tmp_path)
    (run / "ta" / "metrics.json").unlink()  # `featcal run --skip-eval-ta`
    release = export_release(run, tmp_path / "out", repo_id="me/tiny")
    card = ModelCard.load(release / "README.md")
    results = card.text.split("## Results")[1]
    assert "| Task | Zero-shot base | + FeatCal |" in results and "| t0 | 20.00 | **70.00** |" in results
    shutil.rmtree(run / "featcal-ta")
    with pytest.raises(FeatcalError, match="ta/metrics.json is missing"):
        read_run(run)
