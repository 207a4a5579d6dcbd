"""FeatCal: statistics, closed-form solves, architecture adapters, the layer-by-layer driver, and
the calibration of several settings together (sweeps).

Names are imported on first use, so that reading the FeatCal parameters
(:mod:`featcal.calibration.params`, which every ``--help`` does) imports no torch.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    "FeatCalibrator": "featcal.calibration.driver",
    "featcal_calibrate": "featcal.calibration.driver",
    "FeatCalParams": "featcal.calibration.params",
    "SweepCalibrator": "featcal.calibration.sweep",
    "featcal_calibrate_many": "featcal.calibration.sweep",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
