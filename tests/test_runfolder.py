"""The run folder module: stage names, the typed metrics report, and reading good and damaged folders."""

import json
import math

import pytest

from featcal.errors import FeatcalError, RunFolderError
from featcal.runfolder import (
    METRICS,
    RUN_CONFIG,
    MetricsReport,
    TaskMetrics,
    calibrated_stage_name,
    merged_stage_name,
    read_run,
    recipe_sha256,
    write_run_config,
    write_stage_report,
)
from featcal.tasks import parse_task_table
from tests.support.release_runs import CALIBRATED_ACC, MERGED_ACC, make_run


def test_stage_names_keep_the_reference_runs_folders() -> None:
    assert (merged_stage_name("task_arithmetic"), calibrated_stage_name("task_arithmetic")) == ("ta", "featcal-ta")
    assert (merged_stage_name("wudi"), calibrated_stage_name("wudi")) == ("wudi", "featcal-wudi")


def test_report_round_trips_in_the_flat_reference_layout(tmp_path) -> None:
    report = MetricsReport.from_results(
        {"a": TaskMetrics(0.5, 1.0, 10), "b": TaskMetrics(0.25, 2.0, 4)}, model_info={"all_params": 3}
    )
    assert report.average == {"accuracy": 0.375, "loss": 1.5}
    write_stage_report(tmp_path / "stage", report, "abc")
    data = json.loads((tmp_path / "stage" / METRICS).read_text())
    assert list(data) == ["model_info", "a", "b", "average", "run_id"]
    assert json.loads((tmp_path / "stage" / "run.log").read_text()) == data
    assert len((tmp_path / "stage" / "run.log").read_text().splitlines()) == 1
    parsed = MetricsReport.from_json(data)
    assert parsed.tasks == report.tasks and parsed.run_id == "abc" and parsed.accuracy("average") == 0.375


def test_a_task_cannot_be_named_like_a_report_key() -> None:
    entry = {"dataset": "x/y", "classnames": ["a", "b"], "templates": ["{}"]}
    for name in ("average", "model_info", "run_id"):
        with pytest.raises(FeatcalError, match="reserved for the metrics report"):
            parse_task_table({"tasks": {name: entry}})


def test_run_config_holds_its_own_hash(tmp_path) -> None:
    run_id = write_run_config(tmp_path, {"b": 1, "a": [2]})
    config = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert config["run_id"] == run_id == recipe_sha256(config)


def test_reads_a_good_run(tmp_path) -> None:
    path, info = make_run(tmp_path, with_experts=True)
    run = read_run(path)
    assert run.recipe_sha256 == info["run_id"] and [t.name for t in run.tasks] == ["t0", "t1", "t2"]
    assert run.released is run.calibrated and run.calibrated.name == "featcal-ta"
    assert {t: run.calibrated.report.accuracy(t) for t in CALIBRATED_ACC} == CALIBRATED_ACC
    assert {t: run.merged.report.accuracy(t) for t in MERGED_ACC} == MERGED_ACC
    assert run.base_metrics is not None and run.expert_metrics is not None and run.timings["calibrate_s"] == 2.25


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda run: (run / RUN_CONFIG).unlink(), "run_config.json is missing"),
        (lambda run: (run / RUN_CONFIG).write_text("{"), "is not valid JSON"),
        (lambda run: (run / RUN_CONFIG).write_text("[]"), "must hold a JSON object"),
        (lambda run: (run / RUN_CONFIG).write_text('{"tasks": []}'), "is this a featcal run folder?"),
        (lambda run: (run / "featcal-ta" / METRICS).unlink(), "featcal-ta/metrics.json is missing"),
        (lambda run: (run / "featcal-ta" / METRICS).write_text('{"t0": {"accuracy": 1}}'), "no accuracy for task"),
        (lambda run: _edit_json(run / "ta" / METRICS, run_id="other"), "belongs to another run"),
        (lambda run: _edit_json(run / RUN_CONFIG, seed=7), "was edited after the run"),
    ],
)
def test_damaged_runs_are_refused_naming_the_file(tmp_path, damage, message: str) -> None:
    path, _ = make_run(tmp_path)
    damage(path)
    with pytest.raises(RunFolderError, match=message) as info:
        read_run(path)
    assert info.value.ref is not None and str(path) in info.value.ref


def _edit_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_loss_reads_as_nan() -> None:
    report = MetricsReport.from_json({"t": {"accuracy": 1.0}})
    assert math.isnan(report.tasks["t"].loss)
