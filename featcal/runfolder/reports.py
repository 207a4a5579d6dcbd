"""A stage's evaluation report in the run folder: ``metrics.json`` and its one-line twin ``run.log``."""

from __future__ import annotations

from pathlib import Path

from featcal.files.atomic import atomic_write_json
from featcal.files.reading import read_json
from featcal.metrics import MetricsReport
from featcal.runfolder.layout import METRICS, RUN_LOG
from featcal.runfolder.reader import read_json_file


def write_stage_report(folder: Path, report: MetricsReport, run_id: str) -> None:
    """Write a stage's ``metrics.json`` and its one-line twin ``run.log``, both naming the run."""
    data = report.with_run_id(run_id).to_json()
    atomic_write_json(folder / METRICS, data)
    atomic_write_json(folder / RUN_LOG, data, indent=None)


def restamp_report(folder: Path, run_id: str) -> MetricsReport:
    """A finished stage's report, rewritten with ``run_id`` when it names an older recipe."""
    report = MetricsReport.from_json(read_json_file(folder / METRICS, f"Stage {folder.name!r}"), where=folder)
    if report.run_id != run_id:
        write_stage_report(folder, report, run_id)
    return report.with_run_id(run_id)


def stage_report(folder: Path, run_id: str, *, writes: bool = True) -> MetricsReport:
    """A finished stage's report under ``run_id``: restamped in its folder by the process that writes the run
    (:func:`restamp_report`), read as it is by the others."""
    if writes:
        return restamp_report(folder, run_id)
    return MetricsReport.from_json(read_json(folder / METRICS)).with_run_id(run_id)
