"""`featcal run` on T5: merge → evaluate → FeatCal → evaluate → export, resumed, and the built-in glue8 suite.

The models are tiny T5s (``tests/support/tiny_t5.py``) with two tasks from local JSON-lines files: a
classification task (class ids made words) and a regression task scored by Spearman's ρ, as STS-B is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from featcal.cli import main
from featcal.suites import describe_suite, suite_table
from tests.support.tiny_t5 import pairs, save_model

RUN = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu", "--eval-num-workers", "0"]


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("t5run")
    base = save_model(root / "base", seed=0)
    tasks = {}
    for i, (name, entry) in enumerate(
        {
            "cls": {"target": "{label}", "labels": ["w1", "w2"], "reference_accuracy": {"task_arithmetic": 0.625}},
            "reg": {"target": "{score:.1f}", "metric": "spearman"},
        }.items()
    ):
        save_model(root / f"t5-tiny_glue-{name}", seed=10 + i, base=base)
        rows = [{"sentence": t, "label": j % 2, "score": float(j % 5)} for j, (t, _) in enumerate(pairs(20 + i, 16))]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tasks[name] = {"family": "seq2seq", "dataset": {"path": f"{name}.jsonl"}, "expert": f"t5-tiny_glue-{name}",
                       "input": "rate: {sentence}", **entry}  # fmt: skip
    (root / "tasks.yaml").write_text(yaml.safe_dump({"base_model": "base", "tasks": tasks}))
    return root / "tasks.yaml"


@pytest.fixture(scope="module")
def run(tasks_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "t5"
    assert main(["-q", "run", "--tasks-file", str(tasks_file), "--output-dir", str(out), *RUN]) == 0
    return out


def test_a_t5_run_writes_every_stage_and_its_scores(run) -> None:
    for stage in ("ta", "featcal-ta"):
        metrics = json.loads((run / stage / "metrics.json").read_text())
        assert metrics["cls"]["metric"] == "exact_match" and metrics["reg"]["metric"] == "spearman"
        # the file's 16 rows less the 8 the calibration read: positions 8 to 15 of the seed-42 shuffle
        assert metrics["cls"]["num_samples"] == 8
        assert metrics["cls"]["held_out"] == {"split": "train", "seed": 42, "rows": [8, 16]}
        # each task's score under its metric's name, none under "accuracy"; the average is their mean
        assert "accuracy" not in metrics["cls"] and "accuracy" not in metrics["reg"]
        assert metrics["average"]["accuracy"] == pytest.approx(
            (metrics["cls"]["exact_match"] + metrics["reg"]["spearman"]) / 2
        )
    record = json.loads((run / "run_config.json").read_text())
    assert record["family"] == "seq2seq"
    assert record["evaluation"]["generation"] == {"max_length": 10, "do_sample": False, "num_beams": 1}
    config = json.loads((run / "featcal-ta" / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"]


def test_a_rerun_skips_every_stage(run, tasks_file, capsys) -> None:
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")}
    assert main(["run", "--tasks-file", str(tasks_file), "--output-dir", str(run), *RUN]) == 0
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")} == before


def test_the_release_is_a_text2text_generation_model_with_its_card(run) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSeq2SeqLM

    release = run / "release"
    card = ModelCard.load(release / "README.md")
    assert card.data.pipeline_tag == "text2text-generation"
    assert {"t5", "featcal", "task-arithmetic"} <= set(card.data.tags)
    metrics = {r.dataset_name: r.metric_type for r in card.data.eval_results}
    assert metrics == {"cls": "exact_match", "reg": "spearmanr"}
    assert "AutoModelForSeq2SeqLM" in card.text and "Spearman" in card.text
    model = AutoModelForSeq2SeqLM.from_pretrained(release)
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert (release / "tokenizer.json").is_file()
    assert "training examples per task" in card.text and "images" not in card.text
    cls_row = [line for line in card.text.splitlines() if line.startswith("| cls |")][-1]  # the results table's
    assert "Published reference" in card.text and cls_row.endswith("| 62.50 |"), cls_row


def test_a_t5_release_claims_no_license_of_its_own_unless_given(run, tmp_path) -> None:
    """featcal's default license, MIT, is that of the CLIP weights; a T5 merge inherits the licenses of its base
    and experts (FLAN-T5's is Apache-2.0), which featcal does not know: its card says ``other`` and that none was
    given, as a language model's does, until ``--license`` names one."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "release" / "README.md")
    assert card.data.license == "other" and "License:** none was given" in card.text
    assert main(["-q", "card", str(run), "--output", str(tmp_path / "card"), "--license", "apache-2.0"]) == 0
    given = ModelCard.load(tmp_path / "card" / "README.md")
    assert given.data.license == "apache-2.0" and "none was given" not in given.text


def test_the_release_config_reads_as_flan_t5_s_own_and_gives_the_stage_s_logits(run) -> None:
    """transformers 5 writes ``tie_word_embeddings: true`` for every T5, which transformers 4 would read as a tied,
    rescaled head: the release says ``false``, as FLAN-T5's own config does, and still loads (transformers 5)
    with its own head, giving the calibrated stage's logits exactly."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    config = json.loads((run / "release" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["scale_decoder_outputs"] is False
    released, stage = (AutoModelForSeq2SeqLM.from_pretrained(run / f).eval() for f in ("release", "featcal-ta"))
    assert released.lm_head.weight is not released.shared.weight
    ids = torch.tensor([[5, 6, 7, 1]])
    with torch.no_grad():
        one, two = (m(input_ids=ids, decoder_input_ids=torch.tensor([[0, 9]])).logits for m in (released, stage))
    assert torch.equal(one, two)


def test_a_t5_release_is_exported_again_and_passes_push_s_checks(run) -> None:
    """Exporting again replaces the release (its tokenizer and generation files are the release's own), and
    ``featcal push``'s check of a release finds it complete: every file of its manifest, unchanged."""
    from featcal.release.check import check_release

    manifest = json.loads((run / "release" / "release_manifest.json").read_text())
    assert main(["-q", "export", str(run)]) == 0
    assert json.loads((run / "release" / "release_manifest.json").read_text()) == manifest
    checked = check_release(run / "release")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {f.path_in_repo for f in checked.files}


def test_the_glue8_suite_is_fusionbench_s_flan_t5_benchmark() -> None:
    table = suite_table("glue8", "flan-t5-base")
    assert table.base_model == "google/flan-t5-base"
    assert list(table.tasks) == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]
    mnli, stsb, rte = table.tasks["mnli"], table.tasks["stsb"], table.tasks["rte"]
    assert mnli.expert == "tanganke/flan-t5-base_glue-mnli" and mnli.dataset.test_split == "validation_matched"
    assert (mnli.dataset.path, mnli.dataset.name, mnli.dataset.train_split) == ("nyu-mll/glue", "mnli", "train")
    assert mnli.text.labels == ("entailment", "neutral", "contradiction")
    assert rte.text.labels == ("yes", "no") and rte.text.input.startswith("Does the text: '{sentence1}'")
    assert stsb.text.target == "{label:.1f}" and stsb.text.metric == "spearman" and not stsb.text.labels
    assert table.tasks["cola"].reference_accuracy["task_arithmetic"] == 0.705
    assert table.reference_average["task_arithmetic"] == 0.789
    assert table.reference_average["task_arithmetic_featcal"] == 0.852
    listing = describe_suite("glue8", "flan-t5-base")
    assert listing["tasks"][7]["reference_accuracy"]["expert"] == pytest.approx(0.88695433)


def test_featcal_tasks_lists_glue8_with_its_metrics_label_words_and_sources() -> None:
    """The listing speaks of the suite's own facts: each task's metric and number of label words (not CLIP's
    classes and templates), FusionBench's FLAN-T5 page as the source of the pre-trained and expert scores, and
    the paper's 85.2, published as an average only."""
    from featcal.cli.suites import format_suite

    listing = describe_suite("glue8", "flan-t5-base")
    mnli, stsb = listing["tasks"][1], listing["tasks"][7]
    assert (mnli["metric"], mnli["classes"], stsb["metric"], stsb["classes"]) == ("exact_match", 3, "spearman", 0)
    assert "flan-t5_generation.md" in listing["single_model_reference_source"]
    text = format_suite(listing)
    assert "clip_vit.md" not in text and "classes" not in text.splitlines()[3]
    assert text.splitlines()[3].split()[4:7] == ["metric", "labels", "pre-trained"]
    assert "task_arithmetic_featcal 85.20" in text


def test_the_glue8_suite_runs_on_flan_t5_base_and_refuses_another_backbone(tmp_path, capsys) -> None:
    """Without --backbone glue8 takes flan-t5-base (its run folder outputs/flan-t5-base-glue8); a CLIP backbone is
    one error line naming it, exit 2, before any work."""
    from featcal.suites import default_backbone, default_output_dir

    assert default_backbone("glue8") == "flan-t5-base" and suite_table("glue8").base_model == "google/flan-t5-base"
    assert default_output_dir("glue8", "flan-t5-base") == "outputs/flan-t5-base-glue8"
    argv = ["-q", "run", "--suite", "glue8", "--backbone", "b32", "--output-dir", str(tmp_path / "out")]
    code = main([*argv, "--device", "cpu"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "flan-t5-base" in err[0] and "'b32'" in err[0], err
    assert not (tmp_path / "out").exists()


def test_two_processes_give_one_process_results(run, tasks_file, tmp_path) -> None:
    """torchrun over 2 processes (gloo): the merge bit for bit, the merged model's scores exactly (each process
    generates for its half of every task: counts summed, the STS-B-like numbers gathered), the calibrated weights
    to float32 rounding (the statistics are summed over the processes in another order)."""
    from safetensors.torch import load_file

    from tests.test_distributed import torchrun

    out = tmp_path / "two"
    done, _ = torchrun(2, ["-q", "run", "--tasks-file", str(tasks_file), "--output-dir", str(out), *RUN, "--no-export"])
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(folder / "ta" / "model.safetensors")) for folder in (run, out))
    assert all(one[k].equal(two[k]) for k in one)
    one, two = (load_file(str(folder / "featcal-ta" / "model.safetensors")) for folder in (run, out))
    for key in one:
        assert float((one[key] - two[key]).norm() / one[key].norm()) < 1e-5, key
    scores = [json.loads((folder / "ta" / "metrics.json").read_text()) for folder in (run, out)]
    for task in ("cls", "reg"):
        metric = scores[0][task]["metric"]
        assert scores[0][task][metric] == scores[1][task][metric]
        assert scores[0][task]["num_samples"] == scores[1][task]["num_samples"] == 8  # held out of the 16


@pytest.mark.parametrize("what", ["run", "release", "--suite glue8"])
def test_the_space_refuses_a_t5_model_and_the_glue8_suite_in_one_line(run, capsys, monkeypatch, what) -> None:
    """The Space classifies images with CLIP vision towers: a T5 run or release, and the glue8 suite, are refused
    in one line, exit 2, before a base CLIP is looked for or a server started."""
    from featcal.space.ui import Space

    monkeypatch.setattr(Space, "launch", lambda self, **kwargs: pytest.fail("the Space was served"))
    args = (
        ["--suite", "glue8"]
        if what == "--suite glue8"
        else ["--model", str(run / ("release" if what == "release" else ""))]
    )
    code = main(["-q", "space", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert ("must be one of ta8, ta14, ta20" if what == "--suite glue8" else "is a 'seq2seq' model") in lines[0], lines


def test_featcal_diagnose_on_a_t5_run_speaks_of_examples_and_the_decoder_s_first_position(run, tmp_path) -> None:
    """The drift report of a T5 run names what it measured: examples (not images) and, as its last point, the
    decoder's final norm at its first position (not a pooled CLS output); its model card says the same."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert main(["-q", "diagnose", str(copy), "--device", "cpu", "--num-images", "4"]) == 0
    report = json.loads((copy / "diagnostics.json").read_text())
    assert report["noun"] == "example" and report["head_point"] == "decoder's final norm at its first position"
    assert "4 test examples per task" in report["summary"] and "CLS" not in report["summary"] + report["definition"]
    assert main(["-q", "export", str(copy)]) == 0
    card = (copy / "release" / "README.md").read_text()
    assert "test examples per task" in card and "decoder's final norm at its first position" in card
