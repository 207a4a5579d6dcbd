"""Every name in a run folder, in one place.

The layout is the FeatCal reference run's::

    <run>/run_config.json        the run record (:mod:`featcal.runfolder.record`) and its hash, ``run_id``
    <run>/zero-shot/             optional: metrics of the zero-shot base model (``base/`` is read too)
    <run>/experts/               optional: metrics of each task's expert on its own task
    <run>/<merged>/              the merged model: ``ta`` for Task Arithmetic, else the method's name
    <run>/featcal-<merged>/      the calibrated model, when FeatCal ran
    <run>/evaluations/           metrics of other models evaluated into the run (``featcal evaluate --output``)
    <run>/timings.json           seconds and peak memory per step
    <run>/diagnostics.json       optional: feature drift from the experts (``featcal diagnose``)
    <run>/diagnostics.png        its plot
    <run>/sweep/                 optional: ``featcal sweep``'s results
    <run>/release/               the release folder written by ``featcal export``
    <run>/stages.json            the stage ledger: which steps finished, from which inputs
    <run>/.featcal.lock          the lock of the process writing the run

Each stage folder holds ``metrics.json`` and ``run.log`` (the same report on one line) and, for
models, ``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
RUN_LOG = "run.log"
TIMINGS = "timings.json"
STAGES_FILE = "stages.json"
LOCK_FILE = ".featcal.lock"
RELEASE_DIR = "release"
ZERO_SHOT_DIR = "zero-shot"
LEGACY_BASE_DIR = "base"  # the zero-shot stage's folder in runs of the reference scripts
EXPERTS_DIR = "experts"
EVALUATIONS_DIR = "evaluations"
DIAGNOSTICS = "diagnostics.json"
DIAGNOSTICS_PLOT = "diagnostics.png"
SWEEP_DIR = "sweep"
CALIBRATED_PREFIX = "featcal-"

# The steps of the stage ledger (``stages.json``); an evaluation's is ``evaluate:<stage folder>``.
MERGE_STEP = "merge"
CALIBRATE_STEP = "calibrate"
DIAGNOSE_STEP = "diagnose"
EXPORT_STEP = "export"


def evaluate_step(folder: str) -> str:
    """The ledger step of the evaluation whose report lies in ``folder`` (``evaluate:ta``)."""
    return f"evaluate:{folder}"


def merged_stage_name(method: str) -> str:
    """The folder of a merge: ``ta`` for Task Arithmetic (the reference run's name), else the method."""
    return "ta" if method == "task_arithmetic" else method


def calibrated_stage_name(method: str) -> str:
    """The folder of the FeatCal-calibrated merge: ``featcal-ta`` for Task Arithmetic."""
    return CALIBRATED_PREFIX + merged_stage_name(method)
