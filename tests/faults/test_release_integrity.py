"""A release says only what the run it comes from holds: read under the run's lock, tied to the very
weights it copies, and never written over somebody's files.

Each test builds a small run folder (``tests/support/release_runs.py``), damages or races it as a user
did, and checks the command refuses in one line (exit 2) with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from featcal.cli import main
from featcal.files.atomic import atomic_folder
from featcal.runfolder.ledger import StageLedger
from tests.support.release_runs import make_run


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def run(tmp_path) -> Path:
    return make_run(tmp_path)[0]


def hold_lock(run: Path) -> subprocess.Popen:
    """Another process that writes ``run``: it holds its lock until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from featcal.runfolder.lock import RunLock\n"
         "with RunLock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{run}"],
        ["export", "{run}", "--output", "{out}"],
        ["card", "{run}"],
        ["card", "{run}", "--output", "{out}"],
        ["push", "{run}", "--repo", "me/x"],
    ],
)
def test_release_commands_wait_for_no_writer_and_refuse_while_a_run_writes(run, tmp_path, capsys, argv):
    holder = hold_lock(run)
    try:
        code, err = run_error(capsys, [a.format(run=run, out=tmp_path / "out") for a in argv])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert code == 2 and len(err) == 1 and f"is being written by process {holder.pid}" in err[0]
    assert not (run / "release").exists() and not (tmp_path / "out").exists()


def test_a_stage_report_of_other_weights_is_not_released(run, capsys):
    """A report copied in from another model (or the stage's weights changed since) is refused."""
    report = json.loads((run / "featcal-ta" / "metrics.json").read_text())
    report["weights_sha256"] = {"model.safetensors": "0" * 64}
    (run / "featcal-ta" / "metrics.json").write_text(json.dumps(report))
    code, err = run_error(capsys, ["export", str(run)])
    assert code == 2 and len(err) == 1
    assert f"{run / 'featcal-ta' / 'metrics.json'} is not the evaluation of the weights in" in err[0]
    assert not (run / "release").exists()


def test_a_calibrated_run_without_its_calibrated_stage_is_not_released_as_the_merge(run, capsys):
    shutil.rmtree(run / "featcal-ta")
    code, err = run_error(capsys, ["export", str(run)])
    assert code == 2 and len(err) == 1 and "calibrated, but featcal-ta/ is missing" in err[0]
    assert not (run / "release").exists()


def test_card_does_not_replace_a_user_s_readme(run, tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# My project\n")
    code, err = run_error(capsys, ["card", str(run), "--output", str(project)])
    assert code == 2 and len(err) == 1 and "holds files that are not a featcal model card's (README.md)" in err[0]
    assert sorted(p.name for p in project.iterdir()) == ["README.md"]
    assert (project / "README.md").read_text() == "# My project\n"
    # an empty folder, and the card's own folder again, are fine
    assert main(["card", str(run), "--output", str(tmp_path / "cards")]) == 0
    assert main(["card", str(run), "--output", str(tmp_path / "cards")]) == 0


def test_a_dry_run_writes_nothing(run, capsys):
    code, err = run_error(capsys, ["push", str(run), "--repo", "me/x", "--dry-run"])
    assert code == 2 and len(err) == 1 and "has no release yet, and a dry run writes nothing" in err[0]
    assert not (run / "release").exists()


def test_a_release_of_a_stage_redone_since_is_not_pushed(run, capsys):
    assert main(["export", str(run)]) == 0
    ledger = StageLedger.read(run)
    ledger.done["calibrate"] = {
        "identity": "x",
        "outputs": ["featcal-ta"],
        "weights": {"featcal-ta/model.safetensors": [1, "f" * 64]},
    }  # the run's ledger as a redone calibration leaves it
    ledger._write()
    code, err = run_error(capsys, ["push", str(run), "--repo", "me/x", "--dry-run"])
    assert code == 2 and len(err) == 1 and "holds other weights than the run's featcal-ta/ holds now" in err[0]


def test_a_killed_export_s_temporary_folder_is_removed_by_the_next(run):
    """A temporary named after a process that no longer runs is that process's leftover."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = run / f".release.{int(dead.stdout)}.abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = run / f".release.{os.getpid()}.def456"  # a process that runs: not touched
    live.mkdir()
    assert main(["export", str(run)]) == 0
    assert not stale.exists() and live.is_dir()


def test_atomic_folders_name_their_temporaries_after_their_process(tmp_path):
    with atomic_folder(tmp_path / "out") as tmp:
        assert tmp.name.startswith(f".out.{os.getpid()}.")
