"""`featcal sweep`: the sample-efficiency curve of FeatCal (accuracy against the calibration size n),
and sweeps of λ, ρ, α or ε, over a run's merged model.

The package itself imports only what parsing a request needs (``featcal --help`` stays light); the
report lives in :mod:`featcal.sweep.report`, the command in :mod:`featcal.sweep.runner`.
"""

from featcal.sweep.request import (
    DEFAULT_SIZES,
    SWEEPABLE,
    SweepRequest,
    SweptParameter,
    parse_parameter,
    parse_sizes,
)

__all__ = ["DEFAULT_SIZES", "SWEEPABLE", "SweepRequest", "SweptParameter", "parse_parameter", "parse_sizes"]
