"""The run folder module: stage names, the typed metrics report, and reading good and damaged folders."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest

from featcal.errors import FeatcalError, RunFolderError, RunLockedError
from featcal.metrics import MetricsReport, TaskMetrics
from featcal.runfolder.layout import LOCK_FILE, METRICS, RUN_CONFIG, calibrated_stage_name, merged_stage_name
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import read_run
from featcal.runfolder.record import SCHEMA, RunRecord, read_run_config, recipe_sha256, write_run_config
from featcal.runfolder.reports import write_stage_report
from featcal.tasks import parse_task_table
from tests.support.release_runs import CALIBRATED_ACC, MERGED_ACC, make_run, tiny_config, with_run_id


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


def a_record(**changes) -> RunRecord:
    """A run record of two tasks, as `featcal run` writes one."""
    record = RunRecord.from_json(tiny_config(), "run_config.json")
    return dataclasses.replace(record, **changes)


def test_run_config_holds_its_own_hash_and_schema(tmp_path) -> None:
    record = a_record()
    run_id = write_run_config(tmp_path, record)
    config = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert config["run_id"] == run_id == recipe_sha256(config) == record.run_id
    assert (config["schema"], config["family"]) == (SCHEMA, "clip_vision")
    read = read_run_config(tmp_path / RUN_CONFIG, "run")
    assert read.record == record and read.recipe_sha256 == run_id


def test_the_record_round_trips_every_field() -> None:
    record = a_record(seed=7, precision="bf16", suite="ta14", backbone="b16")
    assert RunRecord.from_json(record.to_json()) == record
    assert record.merge.merged_from is None and record.featcal.params.lambda_ratio == 0.05


def test_a_record_without_schema_is_read_as_schema_1_and_keeps_its_hash(tmp_path) -> None:
    legacy = with_run_id(tiny_config())  # the layout written before the schema was recorded
    assert "schema" not in legacy and "family" not in legacy
    (tmp_path / RUN_CONFIG).write_text(json.dumps(legacy))
    read = read_run_config(tmp_path / RUN_CONFIG, "run")
    assert read.recipe_sha256 == legacy["run_id"]  # the run's id is the file's own hash
    assert read.record.schema == SCHEMA and read.record.family == "clip_vision"
    assert read.record.to_json() | {"schema": 1} != legacy  # converted, not the same bytes


def test_a_newer_schema_is_refused_in_one_line(tmp_path) -> None:
    config = a_record().to_json() | {"schema": SCHEMA + 1}
    (tmp_path / RUN_CONFIG).write_text(json.dumps(config))
    with pytest.raises(RunFolderError, match=f"record schema {SCHEMA + 1}, newer than this featcal's .*upgrade"):
        read_run_config(tmp_path / RUN_CONFIG, "run")


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


def test_hub_commits_are_recorded_when_there_are_some_and_leave_a_local_run_s_id_alone(tmp_path) -> None:
    local = RunRecord.from_json(tiny_config())
    assert "hub_commits" not in local.to_json()
    pinned = dataclasses.replace(local, hub_commits={"models": {"ns/base": "a" * 40}, "datasets": {}})
    assert pinned.to_json()["hub_commits"] == {"models": {"ns/base": "a" * 40}}  # empty kinds left out
    assert pinned.run_id != local.run_id
    assert RunRecord.from_json(pinned.to_json()).commit_of("models", "ns/base") == "a" * 40
    assert RunRecord.from_json(pinned.to_json()).commit_of("datasets", "t0") is None
    with pytest.raises(RunFolderError, match="'hub_commits' must map"):
        RunRecord.from_json({**tiny_config(), "hub_commits": {"models": "a"}}, tmp_path / "run_config.json")


def test_an_output_dtype_is_recorded_only_when_set_and_leaves_a_default_run_s_id_alone() -> None:
    default = RunRecord.from_json(tiny_config())
    assert "output_dtype" not in default.to_json() and default.output_dtype is None
    wide = dataclasses.replace(default, output_dtype="float32")
    assert wide.to_json()["output_dtype"] == "float32" and wide.run_id != default.run_id
    assert RunRecord.from_json(wide.to_json()) == wide


def test_missing_loss_reads_as_nan() -> None:
    report = MetricsReport.from_json({"t": {"accuracy": 1.0}})
    assert math.isnan(report.tasks["t"].loss)


def test_readers_share_the_lock_and_exclude_a_writer(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run, shared=True), RunLock(run, shared=True):  # two readers at once
        with pytest.raises(RunLockedError, match="is being read by another featcal process"):
            RunLock(run).__enter__()
    assert not (run / LOCK_FILE).exists()  # the last reader removed it
    with RunLock(run):  # a reader in another process is refused while this one writes
        reader = subprocess.run(
            [sys.executable, "-c", _READ_ONCE, str(run)], capture_output=True, text=True, timeout=120, check=False
        )
        assert reader.returncode == 3, reader.stderr
        assert re.search(r"is being written by process \d+", reader.stdout), reader.stdout
        with RunLock(run, shared=True):  # within the writing process a read nests in the write
            pass
        assert (run / LOCK_FILE).exists()
    assert not (run / LOCK_FILE).exists()


_READ_ONCE = """
import sys
from pathlib import Path
from featcal.errors import RunLockedError
from featcal.runfolder.lock import RunLock
try:
    with RunLock(Path(sys.argv[1]), shared=True):
        pass
except RunLockedError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_lock_on_a_removed_file_is_not_held(tmp_path, monkeypatch) -> None:
    """A process that locks the lock file just after its last holder removed it locks the file at the path
    instead, so that it and a process that creates the file anew cannot both hold the lock."""
    import os

    from featcal.runfolder import lock as lock_module

    run = tmp_path / "run"
    run.mkdir()
    opened = []
    real_open = os.open

    def open_then_lose_the_file(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:  # the first open: the file is removed (by its last holder) before it is locked
            os.unlink(path)
        opened.append(fd)
        return fd

    monkeypatch.setattr(lock_module.os, "open", open_then_lose_the_file)
    with RunLock(run) as held:
        assert len(opened) == 2 and (run / LOCK_FILE).is_file()
        assert os.path.samestat(os.fstat(held._fd), os.stat(run / LOCK_FILE))
