"""FeatCal: statistics, closed-form solves, architecture adapters, the layer-by-layer driver, and
the calibration of several settings together (sweeps)."""

from featcal.calibration.adapters import CLIPVisionAdapter
from featcal.calibration.driver import FeatCalibrator, FeatCalParams, featcal_calibrate
from featcal.calibration.sweep import SweepCalibrator, featcal_calibrate_many

__all__ = [
    "CLIPVisionAdapter",
    "FeatCalParams",
    "FeatCalibrator",
    "SweepCalibrator",
    "featcal_calibrate",
    "featcal_calibrate_many",
]
