"""`featcal evaluate` on a model folder of another family than its tasks', and the help texts of evaluate,
merge and calibrate, which speak of every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal.cli import main
from featcal.metrics import MetricsReport, TaskMetrics, task_score
from tests.support.runs import CPU


def _folder(tmp_path: Path, model_type: str) -> Path:
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize(
    ("model_type", "title", "hint"),
    [("llama", "causal language model (causal_lm)", "family: causal_lm"), ("t5", "T5 encoder-decoder", "glue8")],
)
def test_a_language_model_folder_on_the_default_suite_is_refused_naming_what_to_pass(
    tmp_path, capsys, model_type, title, hint
) -> None:
    folder = _folder(tmp_path, model_type)
    code = main(["-q", "evaluate", "--model", str(folder), *CPU])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert title in err[0] and "the suite ta8 holds CLIP vision tower tasks" in err[0], err[0]
    assert "--tasks-file FILE" in err[0] and hint in err[0] and "clip-vit" not in err[0], err[0]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]  # no metrics.json written


def test_a_clip_folder_on_a_language_tasks_file_is_refused(world, tmp_path, capsys) -> None:
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"t": {"family": "causal_lm", "dataset": str(tmp_path), "text": "{text}"}}))
    folder = _folder(tmp_path, "clip_vision_model")
    code = main(["-q", "evaluate", "--model", str(folder), "--tasks-file", str(tasks), *CPU])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "CLIP vision tower (clip_vision)" in err[0] and f"the tasks file {tasks}" in err[0], err[0]
    assert not (folder / "metrics.json").exists()


@pytest.mark.parametrize(
    ("command", "option"),
    [("evaluate", None), ("evaluate", "--model"), ("evaluate", "--base-model-id"), ("merge", "--base-model-id"),
     ("merge", "--data"), ("calibrate", "--base-model-id"), ("calibrate", "--data")],
)  # fmt: skip
def test_help_speaks_of_every_family(capsys, command, option) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    paragraphs = capsys.readouterr().out.split("\n\n")
    if option is None:  # the description: the paragraph after the usage
        text = paragraphs[1]
    else:  # the option's own entry, up to the next option
        lines = "\n\n".join(paragraphs[1:]).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option} "))
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
        text = " ".join(lines[start:end])
    text = " ".join(text.split())
    families = ("causal", "T5") if option == "--data" else ("CLIP", "causal", "T5")  # data files: text families'
    assert all(family in text for family in families), text


def test_a_t5_score_is_stored_under_its_metric_s_name_and_old_files_still_read() -> None:
    fresh = TaskMetrics(0.75, 0.5, 8, {"metric": "exact_match"}).to_json()
    assert fresh == {"exact_match": 0.75, "loss": 0.5, "num_samples": 8, "metric": "exact_match"}
    rho = TaskMetrics(0.25, 0.5, 8, {"metric": "spearman"}).to_json()
    assert rho["spearman"] == 0.25 and "accuracy" not in rho
    old = {"accuracy": 0.75, "loss": 0.5, "num_samples": 8, "metric": "exact_match"}
    for entry in (fresh, old):
        report = MetricsReport.from_json({"cls": entry, "average": {"accuracy": 0.75, "loss": 0.5}})
        assert report.accuracy("cls") == 0.75 and task_score(entry) == 0.75
        assert report.to_json()["cls"] == fresh  # read back, written under the metric's name
    # a language model's exact match stays beside its loss, not its score
    lm = MetricsReport.from_json({"t": {"loss": 1.0, "exact_match": 0.5}})
    assert lm.tasks["t"].accuracy is None and lm.tasks["t"].extra["exact_match"] == 0.5
