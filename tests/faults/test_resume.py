"""Runs resume and lock: a killed run, run again, ends with the outputs of an uninterrupted run.

Kills are real SIGKILLs of a `featcal run` subprocess at named points (``FEATCAL_KILL_AT``, see
``featcal.files.faults.fault_point``), the way a rented machine's loss would stop it. On each device the
outputs are compared bit for bit with those of an uninterrupted run on that same device.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from featcal.cli import main
from tests.support.runs import fast_run

FAST = [*fast_run(max_eval_samples=3), "--eval-zero-shot"]
# Files whose bytes depend on wall time, not on the inputs: the timings, the card's timing table, and
# the release manifest that records the card's hash.
TIMED = {"timings.json", "release/README.md", "release/release_manifest.json"}


def featcal(world, out: Path, device: str, *extra: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "FEATCAL_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FEATCAL_KILL_AT", None)
    if kill_at:
        env["FEATCAL_KILL_AT"] = kill_at
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, *extra]
    argv += ["--device", device]
    return subprocess.run(
        [sys.executable, "-m", "featcal", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` by relative path (hidden entries included)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory, device) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = featcal(world, out, device)
    assert result.returncode == 0, result.stderr
    return snapshot(out)


def comparable(files: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in files.items() if k not in TIMED}


@pytest.mark.parametrize(
    "point",
    ["after:run_config", "replace:ta", "after:merge", "calibrate:layer1", "replace:featcal-ta",
     "after:evaluate:featcal-ta", "replace:release"],
)  # fmt: skip
def test_a_killed_run_resumes_to_the_uninterrupted_outputs(world, tmp_path, reference, point: str, device) -> None:
    out = tmp_path / "run"
    killed = featcal(world, out, device, kill_at=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = featcal(world, out, device)
    assert resumed.returncode == 0, resumed.stderr
    files = snapshot(out)
    assert comparable(files) == comparable(reference)
    assert set(files) == set(reference)  # no leftovers: no temporary files, no lock
    assert not [p for p in out.rglob(".*")]


def test_a_rerun_skips_finished_stages_and_says_so(world, tmp_path, device) -> None:
    out = tmp_path / "run"
    assert featcal(world, out, device).returncode == 0
    before = snapshot(out)
    again = subprocess.run(
        [sys.executable, "-m", "featcal", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out),
         *FAST, "--device", device],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FEATCAL_NO_PROGRESS": "1"},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    for stage in ("Merge: ta/", "FeatCal: featcal-ta/", "Evaluation of zero-shot/", "Release: release/"):
        assert f"{stage} is up to date" in again.stderr
    assert comparable(snapshot(out)) == comparable(before)


def test_changed_inputs_redo_that_stage_and_everything_after(world, tmp_path, capsys, device) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    assert main(argv) == 0
    first = snapshot(out)
    assert main([*argv, "--lambda-ratio", "0.5"]) == 0
    second = snapshot(out)
    # the merge and the zero-shot evaluation are kept; FeatCal and its evaluation are redone
    assert second["ta/model.safetensors"] == first["ta/model.safetensors"]
    assert second["featcal-ta/model.safetensors"] != first["featcal-ta/model.safetensors"]
    run_id = json.loads((out / "run_config.json").read_text())["run_id"]
    for stage in ("zero-shot", "ta", "featcal-ta", "release"):
        assert json.loads((out / stage / "metrics.json").read_text())["run_id"] == run_id
    # back to the first recipe: the outputs are those of the first run again
    assert main(argv) == 0
    assert comparable(snapshot(out)) == comparable(first)
    # without FeatCal, the calibrated stage is stale and removed, with the release of the old run
    assert main([*argv, "--skip-featcal", "--no-export"]) == 0
    assert not (out / "featcal-ta").exists() and not (out / "release").exists()


def test_damaged_weights_of_a_finished_stage_are_redone(world, tmp_path, device) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    assert main(argv) == 0
    first = snapshot(out)
    merged = out / "ta" / "model.safetensors"
    merged.write_bytes(merged.read_bytes()[: merged.stat().st_size // 2])  # truncated
    calibrated = out / "featcal-ta" / "model.safetensors"
    data = bytearray(calibrated.read_bytes())
    data[-5] ^= 0xFF  # one byte of tensor data flipped: same size
    calibrated.write_bytes(bytes(data))
    assert main(argv) == 0  # both stages redone (and their evaluations): every file as before the damage
    assert comparable(snapshot(out)) == comparable(first)


def test_a_stage_report_of_other_weights_is_redone_and_the_release_shows_the_stage_s_own(world, tmp_path, device):
    """featcal-ta/metrics.json replaced by another model's report (an expert's, by `featcal evaluate`): the
    resume measures the stage's weights again instead of keeping it, and the release publishes their results."""
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    assert main([*argv, "--no-export"]) == 0
    first = snapshot(out)
    stage_report = out / "featcal-ta" / "metrics.json"
    own = json.loads(stage_report.read_text())
    foreign = tmp_path / "foreign.json"
    expert = world["root"] / "experts" / world["tasks"][0]
    evaluate = ["-q", "evaluate", "--model", str(expert), "--tasks-file", str(world["tasks_file"]), "--device", device]
    assert main([*evaluate, "--max-eval-samples", "3", "--eval-num-workers", "0", "--output", str(foreign)]) == 0
    results = {t: json.loads(foreign.read_text())[t] for t in world["tasks"]}
    assert results != {t: own[t] for t in world["tasks"]}  # another model's results, told apart by their losses
    stage_report.write_bytes(foreign.read_bytes())
    assert main([*argv, "--no-export"]) == 0  # the evaluation is redone: every file as before the copy
    assert comparable(snapshot(out)) == comparable(first)
    assert main(["-q", "export", str(out)]) == 0
    released = json.loads((out / "release" / "metrics.json").read_text())
    assert {t: released[t] for t in world["tasks"]} == {t: own[t] for t in world["tasks"]}


def test_force_redoes_everything(world, tmp_path, caplog, device) -> None:
    out = tmp_path / "run"
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--no-export"]
    argv += ["--device", device]
    assert main(["-q", *argv]) == 0
    stamp = (out / "ta" / "model.safetensors").stat().st_mtime_ns
    assert main(["-q", *argv, "--force"]) == 0
    assert (out / "ta" / "model.safetensors").stat().st_mtime_ns != stamp


def test_another_run_in_the_folder_is_refused_unless_forced(world, tmp_path, capsys, device) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--no-export"]
    argv += ["--device", device]
    assert main(argv) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main([*argv, "--tasks", "task0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a run with another tasks" in err and "--force" in err and len(err.splitlines()) == 1
    assert snapshot(out) == before
    assert main([*argv, "--tasks", "task0", "--force"]) == 0
    assert json.loads((out / "run_config.json").read_text())["tasks"] == ["task0"]


def test_a_run_folder_with_a_damaged_run_config_is_refused_unless_forced(world, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "run_config.json").write_text('{"tasks": [')
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged (not a JSON object)" in err[0] and "--force" in err[0]
    assert (out / "run_config.json").read_text() == '{"tasks": ['
    assert main([*argv, "--no-export", "--skip-featcal", "--force"]) == 0  # what the message offers works
    assert json.loads((out / "run_config.json").read_text())["tasks"] == world["tasks"]


@pytest.mark.parametrize("kind", ["file", "foreign folder"])
def test_an_output_path_that_is_not_a_run_folder_is_refused(world, tmp_path, capsys, kind: str) -> None:
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    # refused before any model runs: on the CPU alone
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: --output-dir") and len(err.splitlines()) == 1
    assert (out.read_text() == "mine") if kind == "file" else sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_second_run_on_a_locked_folder_fails_at_once_naming_the_holder(world, tmp_path, capsys, device) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from featcal.runfolder import RunLock\n"
         "with RunLock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST]
        argv += ["--device", device]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert f"is being written by process {holder.pid}" in err and len(err.splitlines()) == 1
        assert time.perf_counter() - start < 30
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died by SIGKILL: its lock is taken over, and the run completes
    assert main([*argv, "--no-export"]) == 0
    assert not (out / ".featcal.lock").exists()


def test_a_validation_error_leaves_no_folder(world, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    # refused before any model runs: on the CPU alone
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", "cpu"]
    assert main([*argv, "--num-calibration-examples", "1000"]) == 2
    err = capsys.readouterr().err
    assert "fewer than the 1000 calibration images" in err and "--allow-fewer-calibration-examples" in err
    assert not out.exists()


def test_a_run_folder_without_a_ledger_is_redone_whole(world, tmp_path, device) -> None:
    """A folder written before stages.json existed (or whose ledger was lost) holds outputs of unknown inputs."""
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    assert main(argv) == 0
    (out / "stages.json").unlink()
    (out / "featcal-ta" / "stale.txt").write_text("left by an older run")
    assert main([*argv, "--skip-featcal", "--no-export"]) == 0
    assert not (out / "featcal-ta").exists() and not (out / "release").exists()
    assert json.loads((out / "stages.json").read_text()).keys() >= {"merge", "evaluate:ta"}
