"""`featcal.progress`: a tqdm bar on a terminal, plain periodic log lines elsewhere, nothing when off."""

import io
import logging
from types import SimpleNamespace

import pytest

from featcal import progress
from featcal.progress import Progress, format_duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A stand-in for time.monotonic that advances only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=clock))  # featcal.progress's clock only
    return clock


@pytest.fixture
def log_file(monkeypatch, caplog, clock):
    """stderr is a file, not a terminal; progress is on and logs into caplog; time stands still."""
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.delenv("FEATCAL_NO_PROGRESS", raising=False)
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "0")
    monkeypatch.setattr(progress, "_enabled", True)
    caplog.set_level(logging.INFO, logger="featcal.progress")
    return stream


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "featcal.progress"]


def test_without_a_terminal_each_step_is_a_plain_log_line(log_file, caplog) -> None:
    assert list(Progress(["a", "b"], desc="Evaluating tasks", unit="tasks")) == ["a", "b"]
    assert lines(caplog) == [
        "Evaluating tasks: 1/2 tasks (50%, 0.0 s)",
        "Evaluating tasks: 2/2 tasks (100%, 0.0 s)",
        "Evaluating tasks: done, 2/2 tasks in 0.0 s",
    ]
    assert log_file.getvalue() == ""  # no bar, so no \r or cursor codes, on stderr


def test_lines_come_at_most_every_interval_and_the_end_says_how_long(log_file, caplog, monkeypatch, clock) -> None:
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "10")
    with Progress(desc="Evaluating mnist", total=400, unit="images") as bar:
        for _ in range(10):
            clock.now += 4
            bar.update(40)
    assert lines(caplog) == [
        "Evaluating mnist: 120/400 images (30%, 12.0 s)",
        "Evaluating mnist: 240/400 images (60%, 24.0 s)",
        "Evaluating mnist: 360/400 images (90%, 36.0 s)",
        "Evaluating mnist: done, 400/400 images in 40.0 s",
    ]


def test_a_transient_loop_logs_its_end_only_if_it_logged_progress(log_file, caplog, monkeypatch) -> None:
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "3600")
    list(Progress(range(3), desc="layer 0: statistics", leave=False))
    assert lines(caplog) == []
    list(Progress(range(3), desc="FeatCal: layers", unit="layers"))
    assert lines(caplog) == ["FeatCal: layers: done, 3/3 layers in 0.0 s"]
    caplog.clear()
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "0")
    list(Progress(range(1), desc="layer 1: statistics", leave=False))
    assert lines(caplog) == ["layer 1: statistics: 1/1 it (100%, 0.0 s)", "layer 1: statistics: done, 1/1 it in 0.0 s"]


def test_unknown_totals_postfix_and_a_failed_loop(log_file, caplog) -> None:
    bar = Progress(iter("ab"), desc="Pretraining", unit="steps")
    for _ in bar:
        bar.set_postfix(loss="0.125")
    assert lines(caplog) == [
        "Pretraining: 1 steps (0.0 s), loss=0.125",
        "Pretraining: 2 steps (0.0 s), loss=0.125",
        "Pretraining: done, 2 steps in 0.0 s, loss=0.125",
    ]
    caplog.clear()
    with pytest.raises(RuntimeError):
        for _ in Progress(range(5), desc="Doomed"):
            raise RuntimeError("boom")
    assert not [line for line in lines(caplog) if "done" in line]


def test_a_bad_interval_falls_back_to_ten_seconds(log_file, caplog, monkeypatch) -> None:
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "soon")
    assert progress.interval_s() == progress.DEFAULT_INTERVAL_S
    assert any("FEATCAL_PROGRESS_INTERVAL='soon'" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "nan")
    assert progress.interval_s() == progress.DEFAULT_INTERVAL_S
    monkeypatch.setenv("FEATCAL_PROGRESS_INTERVAL", "2.5")
    assert progress.interval_s() == 2.5


def test_on_a_terminal_it_is_a_tqdm_bar_and_logs_nothing(log_file, caplog, monkeypatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert progress.is_interactive()
    bar = Progress(range(3), desc="Evaluating tasks", unit="tasks")
    for _ in bar:
        bar.set_postfix(loss="0.5")
    assert (
        "\r" in terminal.getvalue() and "Evaluating tasks" in terminal.getvalue() and "loss=0.5" in terminal.getvalue()
    )
    assert lines(caplog) == []


@pytest.mark.parametrize("stderr", [io.StringIO, Terminal])
def test_off_shows_nothing_anywhere(log_file, caplog, monkeypatch, stderr) -> None:
    stream = stderr()
    monkeypatch.setattr("sys.stderr", stream)
    assert list(Progress(range(2), desc="caller said no", enabled=False)) == [0, 1]
    with progress.disabled():  # featcal -q
        assert not progress.is_enabled()
        list(Progress(range(2), desc="quiet"))
    assert progress.is_enabled()
    monkeypatch.setenv("FEATCAL_NO_PROGRESS", "1")
    assert not progress.is_enabled()
    with Progress(desc="env said no", total=2) as bar:
        bar.update(2)
    assert stream.getvalue() == "" and lines(caplog) == []


def test_counting_without_an_iterable_needs_update() -> None:
    with pytest.raises(TypeError, match="update"):
        list(Progress(desc="nothing to iterate", enabled=False))


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.04, "0.0 s"), (59.94, "59.9 s"), (187, "3 min 07 s"), (7500, "2 h 05 min")]
)
def test_format_duration(seconds, text) -> None:
    assert format_duration(seconds) == text
