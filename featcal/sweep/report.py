"""The sweep's results: ``<run>/sweep/sweep.json`` (and its plot ``sweep.png``), written whole or not
at all, and read back by the model card."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.calibration.params import symbol
from featcal.errors import RunFolderError
from featcal.runfolder.reader import read_json_file

logger = logging.getLogger(__name__)

SWEEP_DIR = "sweep"
SWEEP_FILE = "sweep.json"
SWEEP_PLOT = "sweep.png"
SWEEP_FORMAT = "featcal-sweep/1"


@dataclass(frozen=True)
class SweepPoint:
    """One calibrated setting and its zero-shot result (accuracies 0..1)."""

    params: Mapping[str, Any]
    average: float
    tasks: Mapping[str, float]
    calibration_examples_used: Mapping[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.params["num_calibration_examples"])

    def to_json(self) -> dict[str, Any]:
        data = {"params": dict(self.params), "average": self.average, "tasks": dict(self.tasks)}
        if self.calibration_examples_used:
            data["calibration_examples_used"] = dict(self.calibration_examples_used)
        return data


@dataclass(frozen=True)
class SweepReport:
    """A sweep of one run: what varied, each setting's result, the merged model's for comparison."""

    run_id: str
    merged_model: str
    sizes: tuple[int, ...]
    parameter: str | None
    values: tuple[float, ...]
    points: tuple[SweepPoint, ...]
    merged: SweepPoint | None = None
    seed: int | None = None
    max_eval_samples: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    precision: str = "float32"

    @property
    def tasks(self) -> list[str]:
        return list(self.points[0].tasks) if self.points else []

    def rows(self) -> list[tuple[str, list[float]]]:
        """``(task, accuracies)`` per task and then ``average``, in the order of :attr:`points`."""
        rows = [(task, [p.tasks[task] for p in self.points]) for task in self.tasks]
        return [*rows, ("average", [p.average for p in self.points])]

    def label(self, point: SweepPoint) -> str:
        """What distinguishes ``point`` from the others: ``n=32``, ``λ=0.1`` or ``n=32 λ=0.1``."""
        parts = [f"n={point.size}"] if len(self.sizes) > 1 or self.parameter is None else []
        if self.parameter is not None:
            parts.append(f"{symbol(self.parameter)}={point.params[self.parameter]:g}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        merged = None if self.merged is None else {"average": self.merged.average, "tasks": dict(self.merged.tasks)}
        return {
            "format": SWEEP_FORMAT,
            "run_id": self.run_id,
            "merged_model": self.merged_model,
            "seed": self.seed,
            "max_eval_samples": self.max_eval_samples,
            "precision": self.precision,
            "num_calibration_examples": list(self.sizes),
            "parameter": None if self.parameter is None else {"name": self.parameter, "values": list(self.values)},
            "merged": merged,
            "points": [p.to_json() for p in self.points],
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }

    @classmethod
    def from_json(cls, data: Any, *, where: Path) -> SweepReport:
        """Parse ``sweep.json``.

        Raises:
            RunFolderError: when it is not a featcal sweep or a value is missing or not finite.
        """
        try:
            if data.get("format") != SWEEP_FORMAT:
                raise ValueError(f"format is not {SWEEP_FORMAT}")
            parameter = data.get("parameter")
            merged = data.get("merged")
            report = cls(
                run_id=str(data["run_id"]),
                merged_model=str(data["merged_model"]),
                sizes=tuple(int(n) for n in data["num_calibration_examples"]),
                parameter=None if parameter is None else str(parameter["name"]),
                values=() if parameter is None else tuple(float(v) for v in parameter["values"]),
                points=tuple(_point(p) for p in data["points"]),
                merged=None if merged is None else _point({"params": {"num_calibration_examples": 0}, **merged}),
                seed=data.get("seed"),
                max_eval_samples=data.get("max_eval_samples"),
                timings=dict(data.get("timings") or {}),
                precision=str(data.get("precision", "float32")),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RunFolderError(
                where, f"{where} is not a featcal sweep ({exc}): run `featcal sweep` again, or remove {where.parent}."
            ) from None
        return report


def _point(data: Mapping[str, Any]) -> SweepPoint:
    point = SweepPoint(
        params=dict(data["params"]),
        average=float(data["average"]),
        tasks={str(k): float(v) for k, v in data["tasks"].items()},
        calibration_examples_used={str(k): int(v) for k, v in (data.get("calibration_examples_used") or {}).items()},
    )
    if not all(math.isfinite(v) for v in [point.average, *point.tasks.values()]):
        raise ValueError("an accuracy is not finite")
    return point


def read_sweep(run: Path, run_id: str) -> SweepReport | None:
    """The run's sweep when it has one of this very recipe (``run_id``); None otherwise (a sweep of
    an earlier recipe is stale, and is logged and ignored)."""
    path = Path(run) / SWEEP_DIR / SWEEP_FILE
    if not path.is_file():
        return None
    report = SweepReport.from_json(read_json_file(path, f"Sweep of run {run}"), where=path)
    if report.run_id != run_id:
        logger.warning("%s belongs to another recipe of this run (%s); ignored", path, report.run_id[:12])
        return None
    return report
