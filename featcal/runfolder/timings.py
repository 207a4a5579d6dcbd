"""``timings.json``: seconds and peak memory per step of a run, under one key scheme.

A step's seconds are ``<step>_s``: ``merge_s``, ``calibrate_s``, ``diagnose_s``, and ``eval_<folder>_s``
for the evaluation of a stage folder (``eval_featcal-ta_s``); ``featcal sweep`` records ``calibrate_s``
and ``eval_s`` (all its evaluations) the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal.files.atomic import atomic_write_json
from featcal.runfolder.layout import TIMINGS

EVALUATION = "eval"
LABELS = {
    "merge": "merge",
    "calibrate": "FeatCal calibration",
    "diagnose": "feature-drift diagnostics",
    EVALUATION: "evaluation",
}


def evaluation_step(folder: str | None = None) -> str:
    """The timing step of the evaluation of ``folder`` (``eval_ta``), or of every evaluation (``eval``)."""
    return EVALUATION if folder is None else f"{EVALUATION}_{folder}"


def seconds_key(step: str) -> str:
    """The ``timings.json`` key of a step's seconds: ``<step>_s``."""
    return f"{step}_s"


def timing_label(key: str) -> str:
    """A readable name for a ``timings.json`` key (``eval_<stage>_s`` is the evaluation of a stage)."""
    step = key.removesuffix("_s")
    if step in LABELS:
        return LABELS[step]
    if step.startswith(f"{EVALUATION}_"):
        return f"evaluation of `{step[len(EVALUATION) + 1 :]}/`"
    return key


def write_timings(
    run: Path,
    timings: Mapping[str, float],
    memory: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Write ``timings.json``: seconds per stage, rounded to milliseconds; under ``peak_memory`` the
    process's peak memory in GiB (host RSS; on CUDA, ``torch.cuda.max_memory_allocated``) and each
    stage's (see :class:`featcal.memory.MemoryMeter`); under ``settings`` what the run ran with (torch
    threads)."""
    data: dict[str, Any] = {k: round(v, 3) for k, v in timings.items()}
    if memory:
        data["peak_memory"] = _rounded(memory)
    if settings:
        data["settings"] = dict(settings)
    atomic_write_json(run / TIMINGS, data)


def _rounded(value: Any) -> Any:
    """Floats rounded to 3 decimals, through nested mappings."""
    if isinstance(value, Mapping):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value
