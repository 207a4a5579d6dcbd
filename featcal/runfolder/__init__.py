"""The run folder, a module per job: its layout (:mod:`.layout`), the typed run record (:mod:`.record`)
and its construction from a spec (:mod:`.recording`), each step's identity (:mod:`.identities`), the
removal of stale outputs (:mod:`.cleanup`), reading a finished run (:mod:`.reader`), stage reports
(:mod:`.reports`), the stage ledger (:mod:`.ledger`), the lock (:mod:`.lock`), leftovers of killed
processes (:mod:`.leftovers`) and timings (:mod:`.timings`).

Names are imported on first use from the module that defines them; featcal's own modules import
them from there.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    **dict.fromkeys(
        (
            "RUN_CONFIG",
            "METRICS",
            "RUN_LOG",
            "TIMINGS",
            "STAGES_FILE",
            "LOCK_FILE",
            "RELEASE_DIR",
            "ZERO_SHOT_DIR",
            "EXPERTS_DIR",
            "EVALUATIONS_DIR",
            "DIAGNOSTICS",
            "DIAGNOSTICS_PLOT",
            "SWEEP_DIR",
            "CALIBRATED_PREFIX",
            "merged_stage_name",
            "calibrated_stage_name",
            "evaluate_step",
        ),
        "featcal.runfolder.layout",
    ),
    **dict.fromkeys(
        (
            "RunRecord",
            "MergeRecord",
            "FeatCalRecord",
            "EvaluationRecord",
            "PROCESSES",
            "SCHEMA",
            "recipe_sha256",
            "write_run_config",
            "read_run_config",
        ),
        "featcal.runfolder.record",
    ),
    **dict.fromkeys(
        ("RunFolder", "StageFolder", "read_run", "read_json_file", "check_same_run", "merged_model_folder"),
        "featcal.runfolder.reader",
    ),
    **dict.fromkeys(("write_stage_report", "restamp_report", "stage_report"), "featcal.runfolder.reports"),
    **dict.fromkeys(
        ("run_record", "merge_record", "suite_record", "merge_calibration", "merges_from_data", "recorded_dtype"),
        "featcal.runfolder.recording",
    ),
    "stage_identities": "featcal.runfolder.identities",
    **dict.fromkeys(("clear_stale", "export_identity"), "featcal.runfolder.cleanup"),
    "StageLedger": "featcal.runfolder.ledger",
    "RunLock": "featcal.runfolder.lock",
    "remove_leftovers": "featcal.runfolder.leftovers",
    **dict.fromkeys(("write_timings", "timing_label", "seconds_key", "evaluation_step"), "featcal.runfolder.timings"),
    **dict.fromkeys(("MetricsReport", "TaskMetrics"), "featcal.metrics"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
