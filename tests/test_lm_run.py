"""`featcal run` on language models, end to end on tiny MergeBench stand-ins in local folders: merge →
evaluate → FeatCal → evaluate → export, the held-out evaluation, resume, the lock, refusals and
lm-evaluation-harness on each stage.

The models are tiny Llamas trained in seconds on five synthetic tasks with MergeBench's column names and
prompt (``tests/support/tiny_lm_world.py``); the calibration data file names the local experts and their
datasets, with the built-in mergebench suite's text formats. The run over HTTP with the suite's real ids
is ``test_mergebench_rehearsal.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.cli import main
from featcal.data import calibration_indices, held_out_indices
from featcal.data_file import read_data_file
from featcal.distributed import World
from featcal.families.causal_lm.evaluation import held_out_rows
from featcal.families.causal_lm.settings import LMEvaluationSettings, evaluation_settings
from featcal.families.causal_lm.texts import load_text_split, render_text
from featcal.release.check import check_release
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import read_run
from tests.support.hub_world import REPO_ROOT
from tests.support.tiny_lm_world import ROWS, TASKS, write_data_file

SMALL = [
    "--device", "cpu", "--num-calibration-examples", "8", "--calibration-batch-size", "8", "--eval-num-workers", "0",
    "--max-eval-samples", "8", "--eval-max-new-tokens", "6", "--threads", "1",
]  # fmt: skip
STAGES = ("zero-shot", "experts", "ta", "featcal-ta")


def _inputs(world) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    base = world.models["meta-llama/Llama-3.2-3B"]
    experts = {task: world.models[f"MergeBench/Llama-3.2-3B_{task}"] for task in TASKS}
    datasets = {task: world.datasets[f"MergeBench/{task}_val"] for task in TASKS}
    return base, experts, datasets


@pytest.fixture(scope="module")
def data_file(mergebench_world, tmp_path_factory) -> Path:
    _, experts, datasets = _inputs(mergebench_world)
    return write_data_file(tmp_path_factory.mktemp("data"), experts, datasets)


def run_args(world, data: Path, out: Path, *extra: str) -> list[str]:
    base, _, _ = _inputs(world)
    return ["run", "--data", str(data), "--base-model-id", str(base), *SMALL, *extra, "--output-dir", str(out)]


@pytest.fixture(scope="module")
def lm_run(mergebench_world, data_file, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run") / "run"
    argv = run_args(mergebench_world, data_file, out, "--eval-zero-shot", "--eval-experts")
    assert main(["-q", *argv]) == 0
    return out, argv


def _metrics(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "metrics.json").read_text())


def test_the_held_out_rows_are_those_no_calibration_reads(data_file) -> None:
    """Per task: the evaluation's rows are the shuffle's rows after the calibration's, disjoint from them,
    together the whole split; under torchrun the processes' shares cover them once."""
    table = read_data_file(data_file)
    settings = LMEvaluationSettings(seed=42, held_out_after=8, max_new_tokens=6)
    for task in table.tasks.values():
        rows = load_text_split(task)
        calibration = set(calibration_indices(len(rows), 8, 42))
        held_out = held_out_indices(len(rows), 8, 42)
        assert len(rows) == ROWS and not calibration & set(held_out)
        assert calibration | set(held_out) == set(range(ROWS))
        evaluated = held_out_rows(task, settings, None)
        assert evaluated.texts == tuple(render_text(task, rows[i]) for i in held_out)
        assert evaluated.total == ROWS - 8 and evaluated.record == {"split": "train", "seed": 42, "rows": [8, ROWS]}
        shares = [held_out_rows(task, settings, 5, World(rank=rank, size=2)).texts for rank in (0, 1)]
        assert shares[0] + shares[1] == evaluated.texts[:5]


def test_every_stage_is_measured_on_held_out_rows_and_the_experts_beat_the_base(lm_run) -> None:
    run, _ = lm_run
    record = json.loads((run / "run_config.json").read_text())
    assert record["family"] == "causal_lm"
    assert record["evaluation"] == {"max_eval_samples": 8, "held_out": {"seed": 42, "after": 8}, "max_new_tokens": 6}
    reports = {stage: _metrics(run, stage) for stage in STAGES}
    for stage, report in reports.items():
        for task in TASKS:
            entry = report[task]
            assert math.isfinite(entry["loss"]) and entry["loss"] > 0 and "accuracy" not in entry, (stage, task)
            assert entry["num_samples"] == 8 and entry["tokens"] > 0
            assert entry["held_out"] == {"split": "train", "seed": 42, "rows": [8, 16]}
        assert math.isfinite(report["average"]["loss"])
    for task in TASKS:  # each expert on its own synthetic task, against the base it was trained from
        assert reports["experts"][task]["loss"] < reports["zero-shot"][task]["loss"], task
    math_results = {stage: reports[stage]["math"] for stage in STAGES}
    assert all(r["answers"] == 8 for r in math_results.values())  # every reference has its \boxed{} answer
    assert math_results["experts"]["exact_match"] > math_results["zero-shot"]["exact_match"]
    assert "exact_match" not in reports["ta"]["coding"]  # no single answer: loss only
    assert reports["featcal-ta"]["average"]["loss"] != reports["ta"]["average"]["loss"]


def test_the_release_is_the_calibrated_folder_with_the_run_s_results(lm_run) -> None:
    from transformers import AutoModelForCausalLM

    run, _ = lm_run
    release = run / "release"
    stage = run / "featcal-ta"
    assert (release / "model.safetensors").stat().st_ino == (stage / "model.safetensors").stat().st_ino  # a link
    metrics = json.loads((release / "metrics.json").read_text())
    assert metrics["run_id"] == json.loads((run / "run_config.json").read_text())["run_id"]
    assert metrics["math"] == _metrics(run, "featcal-ta")["math"]
    checked = check_release(release)  # what a push checks, without loading the model
    assert checked.recipe_sha256 == metrics["run_id"]
    card = (release / "README.md").read_text()
    assert "held out of the calibration" in card and "| math exact match (%) |" in card and "closed" in card
    assert "Reference numbers" not in card  # a data-file run has no suite, so no quoted numbers
    assert "featcal's defaults" not in card  # nor a suite's word on where its FeatCal parameters come from
    model = AutoModelForCausalLM.from_pretrained(release)
    ids = torch.tensor([[2, 10, 20, 30]])
    expected = AutoModelForCausalLM.from_pretrained(stage)(ids).logits
    assert torch.equal(model(ids).logits, expected)


def test_a_suite_says_where_its_featcal_parameters_come_from_only_when_they_are_the_defaults(lm_run) -> None:
    from featcal.families.causal_lm.run_card import run_context

    run = read_run(lm_run[0])
    assert run_context(run)["featcal_source"] is None  # no suite
    record = replace(run.record, suite="mergebench", backbone="llama-3.2-3b")
    assert "CLIP ViT-B/32 reference run" in run_context(replace(run, record=record))["featcal_source"]
    assert record.featcal is not None
    for name, value in (("lambda_ratio", 0.1), ("teacher_interp_alpha", 0.5)):
        params = replace(record.featcal.params, **{name: value})
        other = replace(record, featcal=replace(record.featcal, params=params))
        assert run_context(replace(run, record=other))["featcal_source"] is None, name


def test_a_second_run_skips_every_step(lm_run, capsys, caplog) -> None:
    run, argv = lm_run
    written = {stage: (run / stage / "metrics.json").stat().st_mtime_ns for stage in STAGES}
    weights = load_file(str(run / "featcal-ta" / "model.safetensors"))
    with caplog.at_level("INFO"):
        assert main(argv) == 0
    skipped = [r.getMessage() for r in caplog.records if "up to date" in r.getMessage()]
    assert len(skipped) == 7, skipped  # four evaluations, merge, FeatCal, release
    assert {stage: (run / stage / "metrics.json").stat().st_mtime_ns for stage in STAGES} == written
    again = load_file(str(run / "featcal-ta" / "model.safetensors"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    out = capsys.readouterr().out
    assert "closed %" in out and "math exact match %" in out


def test_a_run_folder_another_process_writes_is_refused_in_one_line(lm_run) -> None:
    run, argv = lm_run
    env = {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with RunLock(run):
        result = subprocess.run(
            [sys.executable, "-m", "featcal", "-q", *argv], capture_output=True, text=True, timeout=300, env=env
        )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith("featcal: error:") and "being written" in lines[-1], lines[-1]


def _error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error:"), (code, err)
    return err[0]


def test_bad_inputs_are_refused_in_one_line_and_leave_no_folder(mergebench_world, data_file, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    # every row calibrates: none is left to evaluate on
    argv = run_args(mergebench_world, data_file, out, "--eval-zero-shot")
    argv[argv.index("--num-calibration-examples") + 1] = str(ROWS)
    assert "lower num_calibration_examples" in _error(capsys, argv)
    assert not out.exists()
    message = _error(capsys, run_args(mergebench_world, data_file, out, "--lm-eval-include", str(tmp_path)))
    assert "--lm-eval-include" in message and "lm_eval_tasks" in message
    missing = run_args(mergebench_world, data_file, out, "--lm-eval-tasks", "t", "--lm-eval-include", "nowhere")
    assert "a folder of task definitions" in _error(capsys, missing)
    assert "one of mergebench's" in _error(capsys, ["run", "--suite", "mergebench", "--backbone", "b32"])
    assert not out.exists()


HARNESS_TASK = """\
task: tiny_copy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def harness_tasks(tmp_path_factory) -> Path:
    """A local lm-evaluation-harness task and its data: the harness downloads nothing."""
    folder = tmp_path_factory.mktemp("harness")
    rows = [{"question": f"copy w{i} w{i + 1}", "choices": [f"w{i} w{i + 1}", "w0"], "label": 0} for i in range(6)]
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "tiny_copy.yaml").write_text(HARNESS_TASK.format(data=folder / "data.jsonl"))
    return folder


def test_lm_evaluation_harness_runs_on_a_tiny_model_with_a_local_task(mergebench_world, harness_tasks) -> None:
    from transformers import AutoModelForCausalLM

    from featcal.families.causal_lm.harness import Harness
    from tests.support.tiny_lm_world import tokenizer

    base, _, _ = _inputs(mergebench_world)
    harness = Harness(["tiny_copy"], str(harness_tasks), limit=4)
    results = harness.run(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer())
    assert set(results) == {"tiny_copy"} and 0.0 <= results["tiny_copy"]["acc,none"] <= 1.0


def test_mergebench_asks_the_harness_for_merge_bench_s_tasks_each_expert_for_its_own() -> None:
    from featcal.spec import RunSpec

    asked = {"lm_eval_tasks": ["mergebench", "ifeval", "tiny"]}
    settings = evaluation_settings(RunSpec(suite="mergebench", family_options=asked))
    multilingual = [f"{kind}_{lang}" for lang in ("fr", "es", "de", "ru") for kind in ("m_mmlu", "arc", "hellaswag")]
    assert settings.lm_eval_tasks == ("ifeval", "gsm8k_cot", *multilingual, "tiny")  # each once, in order
    by_task = {"instruction": ("ifeval",), "math": ("gsm8k_cot",), "multilingual": tuple(multilingual)}
    assert settings.lm_eval_by_task == by_task  # coding and safety have none: their benchmarks are not run
    only = evaluation_settings(RunSpec(suite="mergebench", family_options={"lm_eval_tasks": ["gsm8k_cot"]}))
    assert only.lm_eval_by_task == {"math": ("gsm8k_cot",)}
    assert evaluation_settings(RunSpec(suite="mergebench")).to_json().keys() == {"held_out", "max_new_tokens"}


@pytest.mark.slow
def test_the_installed_harness_knows_every_task_of_merge_bench_s_list() -> None:
    """lm-evaluation-harness indexes its own task definitions (about 10 s; nothing is downloaded): MergeBench's
    names are all among them, and a name that is not is refused in one message naming it alone."""
    from featcal.errors import InvalidParameterError
    from featcal.families.causal_lm.harness import Harness
    from featcal.suites import suite_lm_eval

    names = [name for names in suite_lm_eval("mergebench")[0].values() for name in names]
    assert len(names) == 14
    with pytest.raises(InvalidParameterError) as refused:
        Harness([*names, "no_such_task"])
    assert "'no_such_task'" in str(refused.value) and not any(name in str(refused.value) for name in names)


def test_a_run_with_harness_tasks_records_them_for_each_stage(mergebench_world, data_file, harness_tasks, tmp_path):
    out = tmp_path / "run"
    extra = ("--eval-zero-shot", "--lm-eval-tasks", "tiny_copy", "--lm-eval-include", str(harness_tasks))
    assert main(["-q", *run_args(mergebench_world, data_file, out, *extra)]) == 0
    record = json.loads((out / "run_config.json").read_text())["evaluation"]["lm_eval"]
    assert record == {"tasks": ["tiny_copy"], "by_task": {}, "include": str(harness_tasks.resolve())}
    for stage in ("zero-shot", "ta", "featcal-ta"):
        accuracy = _metrics(out, stage)["lm_eval"]["tiny_copy"]["acc,none"]
        assert 0.0 <= accuracy <= 1.0, stage
    card = (out / "release" / "README.md").read_text()
    assert "### lm-evaluation-harness" in card and "| tiny_copy | `acc,none` |" in card


def test_two_processes_under_torchrun_measure_what_one_does(mergebench_world, data_file, lm_run, tmp_path) -> None:
    """Each process evaluates its share of every task's held-out rows; the sums over the processes give one
    process's numbers (losses up to the order of the additions), the calibrated model's up to float rounding,
    and rank 0 alone prints them."""
    from tests.test_distributed import torchrun

    one, _ = lm_run
    out = tmp_path / "run"
    done, _ = torchrun(2, ["-q", *run_args(mergebench_world, data_file, out, "--eval-zero-shot", "--eval-experts")])
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("zero-shot", "experts", "ta"):  # the same models: the same numbers
        for task in TASKS:
            a, b = _metrics(one, stage)[task], _metrics(out, stage)[task]
            assert b.pop("loss") == pytest.approx(a.pop("loss"), rel=1e-6) and a == b, (stage, task)
    for task in TASKS:  # the calibration's statistics are summed over the processes: its model up to rounding
        a, b = _metrics(one, "featcal-ta")[task], _metrics(out, "featcal-ta")[task]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["tokens"] == a["tokens"], task
    assert json.loads((out / "run_config.json").read_text())["processes"] == {"world_size": 2, "backend": "gloo"}
    assert done.stdout.count("closed %") == 1, done.stdout  # rank 0 alone prints the results


def test_the_card_of_a_language_model_run_refuses_a_repository_without_namespace(lm_run, tmp_path, capsys) -> None:
    """`featcal card` checks --repo for a language-model run as for every other card, before writing anything."""
    run, _ = lm_run
    out = tmp_path / "card"
    line = _error(capsys, ["card", str(run), "--output", str(out), "--repo", "no-namespace"])
    assert line == (
        "featcal: error: --repo 'no-namespace' is invalid: it must be 'namespace/name' "
        "(it needs a namespace: use 'your-user-or-org/no-namespace')."
    )
    assert not out.exists()
