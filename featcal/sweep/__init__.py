"""`featcal sweep`: the sample-efficiency curve of FeatCal (accuracy against the calibration size n),
and sweeps of λ, ρ, α or ε, over a run's merged model."""

from featcal.sweep.report import SWEEP_DIR, SWEEP_FILE, SWEEP_PLOT, SweepPoint, SweepReport, read_sweep
from featcal.sweep.request import DEFAULT_SIZES, SWEEPABLE, SweptParameter, parse_parameter, parse_sizes

__all__ = [
    "DEFAULT_SIZES",
    "SWEEPABLE",
    "SWEEP_DIR",
    "SWEEP_FILE",
    "SWEEP_PLOT",
    "SweepPoint",
    "SweepReport",
    "SweptParameter",
    "parse_parameter",
    "parse_sizes",
    "read_sweep",
]
