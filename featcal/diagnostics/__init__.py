"""Feature drift: how far a merged model's features lie from each expert's, per layer and task,
before and after FeatCal (``featcal diagnose``, ``featcal run --diagnose``).

Names are imported on first use, so the CLI's parser does not load torch through this package.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    "DriftMeter": "featcal.diagnostics.drift",
    "FeatureDrift": "featcal.diagnostics.drift",
    "measure_drift": "featcal.diagnostics.drift",
    "DriftReport": "featcal.diagnostics.report",
    "read_report": "featcal.diagnostics.report",
    "diagnose_run": "featcal.diagnostics.run",
    "diagnose_models": "featcal.diagnostics.run",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
