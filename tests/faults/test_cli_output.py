"""Output faults: what `featcal run` writes to a log file (stderr not a terminal), with and without -v and -q.

Each test runs the real command in a subprocess, its stderr a pipe, on the tiny world, with a fresh
datasets cache (so that datasets generates its splits, and would draw its bars) and
FEATCAL_PROGRESS_INTERVAL=0 (a progress line for every step).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.runs import fast_run

REPO = Path(__file__).parents[2]
FAST = fast_run(max_eval_samples=4)
# Whatever an earlier in-process `main(["-q", ...])` or the caller's shell set must not do the CLI's work for it.
CLEARED = {
    "PYTHONPATH",
    "FEATCAL_NO_PROGRESS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_VERBOSITY",
    "TQDM_DISABLE",
}
CURSOR_CODES = ("\r", "\x1b[")


def featcal_run(world, tmp_path: Path, device: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(
        PYTHONPATH=str(REPO),
        FEATCAL_PROGRESS_INTERVAL="0",
        HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"),
        OMP_NUM_THREADS="1",
    )
    argv = [sys.executable, "-m", "featcal", *flags, "run", "--tasks-file", str(world["tasks_file"])]
    argv += ["--output-dir", "run", *FAST, "--device", device]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def logged(stderr: str, level: str) -> list[tuple[str, str]]:
    """(logger, message) of every line logged at ``level``."""
    return re.findall(rf"^{level} (\S+): (.*)$", stderr, re.MULTILINE)


def test_a_log_file_gets_plain_progress_lines_and_absolute_paths(world, tmp_path, device) -> None:
    result = featcal_run(world, tmp_path, device)
    assert not [code for code in CURSOR_CODES if code in result.stderr], result.stderr
    progress = [message for name, message in logged(result.stderr, "INFO") if name == "featcal.progress"]
    assert any(re.fullmatch(r"Evaluating task0: 4/4 images \(100%, \d+\.\d s\)", line) for line in progress)
    for done in ("Evaluating tasks: done, 2/2 tasks in ", "FeatCal: layers: done, 2/2 layers in "):
        assert any(line.startswith(done) for line in progress), progress
    assert any(re.fullmatch(r"Task Arithmetic: \d+/\d+ tensors \(\d+%, \d+\.\d s\)", line) for line in progress)
    assert not logged(result.stderr, "DEBUG")
    run = (tmp_path / "run").resolve()
    assert f"Run folder: {run}\n" in result.stdout and f"Release folder: {run / 'release'}\n" in result.stdout


def test_verbose_is_featcal_debug_logging_only(world, tmp_path, device) -> None:
    result = featcal_run(world, tmp_path, device, "-v")
    assert not [code for code in CURSOR_CODES if code in result.stderr]
    debug = logged(result.stderr, "DEBUG")
    assert ("featcal.calibration.driver", "FeatCal: layer 0 calibrated") in debug
    names = {name for name, _ in debug + logged(result.stderr, "INFO")}
    assert names and all(name == "featcal" or name.startswith("featcal.") for name in names), names
    assert "PIL" not in result.stderr and "STREAM b'IHDR'" not in result.stderr


def test_quiet_shows_no_progress(world, tmp_path, device) -> None:
    result = featcal_run(world, tmp_path, device, "-q")
    assert not [code for code in CURSOR_CODES if code in result.stderr]
    assert "featcal.progress" not in result.stderr and not logged(result.stderr, "INFO"), result.stderr
    assert "Run folder: " in result.stdout


def test_evaluating_a_whole_clip_model_folder_shows_no_load_report(world, tmp_path) -> None:
    """A full CLIPModel folder is evaluated through its vision tower: no transformers load report (its
    text tower's keys as UNEXPECTED rows) and no cursor codes on a stderr that is not a terminal."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(PYTHONPATH=str(REPO), FEATCAL_PROGRESS_INTERVAL="0", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "featcal", "evaluate", "--model", str(world["root"] / "base")]
    argv += ["--tasks-file", str(world["tasks_file"]), "--output", str(tmp_path / "m.json"), "--device", "cpu"]
    argv += ["--eval-num-workers", "0", "--max-eval-samples", "4"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "UNEXPECTED" not in result.stderr and "text_model" not in result.stderr, result.stderr
    assert not [code for code in CURSOR_CODES if code in result.stderr], result.stderr
    assert (tmp_path / "m.json").is_file()
