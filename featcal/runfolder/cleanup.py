"""Clean-up of a run folder before its steps run: the outputs of steps whose inputs changed, of stages
the run cannot produce, and a release that is not of exactly this run.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

from featcal.files.reading import read_json
from featcal.fingerprints import digest
from featcal.runfolder.layout import (
    DIAGNOSTICS,
    DIAGNOSTICS_PLOT,
    EXPERTS_DIR,
    EXPORT_STEP,
    RELEASE_DIR,
    RUN_CONFIG,
    TIMINGS,
    ZERO_SHOT_DIR,
    calibrated_stage_name,
    merged_stage_name,
)
from featcal.runfolder.ledger import StageLedger
from featcal.version import __version__

logger = logging.getLogger(__name__)


def export_identity(ledger: StageLedger, run_id: str) -> str:
    """The release's identity: the run's id and the identity and weights of every finished step."""
    return digest(EXPORT_STEP, __version__, run_id, sorted(
        (name, entry.get("identity"), entry.get("weights"))
        for name, entry in ledger.done.items() if name != EXPORT_STEP
    ))  # fmt: skip


def clear_stale(
    out: Path, ledger: StageLedger, identities: Mapping[str, str], *, merge_method: str, run_id: str, writes: bool
) -> None:
    """Remove outputs whose inputs changed, of stages this run cannot produce, and any release that is not
    of exactly this run; a run folder without a ledger is redone whole.

    Args:
        out: The run folder.
        ledger: Its stage ledger (read, or empty under ``force``); stale entries are discarded from it.
        identities: This run's step identities (:func:`~featcal.runfolder.identities.stage_identities`).
        merge_method: The run's merging method (names its stage folders).
        run_id: The run's id.
        writes: Whether this process writes the folder (rank 0).
    """
    if writes and not ledger.done and (out / RUN_CONFIG).is_file():
        _clear_unrecorded(out, merge_method)
    done = ledger.done
    stale = [n for n in done if n != EXPORT_STEP and not (n in identities and ledger.is_done(n, identities[n]))]
    # A stage whose outputs lie in a stale stage's folder (ta/metrics.json in ta/) goes with it.
    removed = [path for name in stale for path in done[name].get("outputs", [])]
    stale += [
        name
        for name, entry in done.items()
        if name != EXPORT_STEP and name not in stale
        and any(output.startswith(f"{path}/") for output in entry.get("outputs", []) for path in removed)
    ]  # fmt: skip
    for name in stale:
        logger.info("%s: inputs or outputs changed; its earlier output is removed and redone", name)
        ledger.discard(name)
    export = ledger.done.get(EXPORT_STEP)
    if export is not None and export.get("identity") != export_identity(ledger, run_id):
        ledger.discard(EXPORT_STEP)


def _clear_unrecorded(out: Path, merge_method: str) -> None:
    """Stage folders of an earlier run that recorded no ledger (or was forced): all redone."""
    try:
        old = read_json(out / RUN_CONFIG)
    except ValueError:  # damaged: replaced under --force like any other run
        old = {}
    old = old if isinstance(old, dict) else {}
    merge_entry = old.get("merge") if isinstance(old.get("merge"), dict) else {}
    methods = {merge_method, merge_entry.get("method", merge_method)}
    names = {ZERO_SHOT_DIR, EXPERTS_DIR, RELEASE_DIR}
    names |= {merged_stage_name(m) for m in methods} | {calibrated_stage_name(m) for m in methods}
    for name in sorted(names):
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    for name in (TIMINGS, DIAGNOSTICS, DIAGNOSTICS_PLOT):
        (out / name).unlink(missing_ok=True)
