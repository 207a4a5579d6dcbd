"""FeatCal: statistics, closed-form solves, architecture adapters and the layer-by-layer driver."""

from featcal.calibration.adapters import CLIPVisionAdapter
from featcal.calibration.driver import FeatCalibrator, FeatCalParams, featcal_calibrate

__all__ = ["CLIPVisionAdapter", "FeatCalParams", "FeatCalibrator", "featcal_calibrate"]
