"""Post-merge repairs side by side on one run's merge: ``featcal run --repair featcal surgery svc ...``.

Every requested repair starts from the run's merged folder and reads the run's calibration draw (the same
tasks, ``num_calibration_examples`` and seed). Each runs as ``featcal calibrate --method NAME`` in a child
process of its own, so that its wall time and peak resident memory are its own: the time is the child's
wall clock from start to exit (imports, loading the models and data, the repair, writing its output), the
peak RSS the child's own high-water mark, which it reports itself (:mod:`featcal.repairs.measured`). A child
that only imports what a repair imports (torch, transformers, featcal) is measured once per comparison as the
floor every child pays. The repaired
models (and, for Representation Surgery and ProbSurgery, the merge with their modules) are then evaluated in
this process on the run's test examples.

Results go to ``<run>/repairs/<name>.json`` (written once the repair is evaluated, atomically) beside the
repair's output folder ``<run>/repairs/<name>/``. A result records the identity of what it was computed
from (the run's id, the merged weights, the repair's command); a later ``featcal run --repair`` keeps a
result whose identity is unchanged and redoes the others.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError, InvalidParameterError
from featcal.options import flag_name, option_fields
from featcal.repairs.entries import ComparedRepair, compared_repairs, shown_value
from featcal.repairs.options import DEFAULT_REPAIR, MODULE_REPAIRS
from featcal.repairs.registry import Repair
from featcal.spec import RUNTIME, TASKS, RunSpec

REPAIRS_DIR = "repairs"  # in the run folder: each repair's output folder and result file
COMPARISON_VERSION = 2
# The run options each kind of repair's `featcal calibrate` reads (the others it refuses or ignores).
CALIBRATION_DRAW = ("num_calibration_examples", "calibration_batch_size", "allow_fewer_calibration_examples")
DATA_FREE = ("cache_dir", "device", "precision", "threads", "dist_timeout", "output_dtype")
NOT_READ = ("seed",)  # a data-free repair reads no draw


@dataclasses.dataclass(frozen=True)
class ChildCost:
    """What one child process cost: its wall time (s) and its own peak resident set (bytes)."""

    seconds: float
    peak_rss_bytes: int


def check_comparison(spec: RunSpec, entries: Sequence[Any]) -> list[ComparedRepair]:
    """Refuse, before any work, a comparison that could not finish: an unknown repair or hyper-parameter, a
    value of the wrong type or out of range, a repair not defined for the run's family, a repair that reads
    calibration data when a task has none, and a run that resumes from a merge the repairs could not start from.

    Args:
        spec: The run.
        entries: The repairs asked for, each with its hyper-parameters (:mod:`featcal.repairs.entries`).

    Returns:
        The entries, in the order given.

    Raises:
        UnknownNameError: for a name no repair has, or a hyper-parameter the repair does not have.
        InvalidParameterError: for a malformed entry, a wrong or out-of-range value, an entry repeated (the same
            repair and hyper-parameters), or a repair not defined for the family.
        DatasetInputError: when a data-using repair is asked for and a task's train split is missing or small.
        ModelInputError: as :func:`featcal.resolve.resolve_inputs`.
    """
    from featcal.data import validate_datasets
    from featcal.repairs.lot import check_lot_family
    from featcal.repairs.surgery import check_surgery_family
    from featcal.resolve import resolve_inputs

    compared = compared_repairs(entries, spec.featcal)
    repairs = [entry.repair for entry in compared]
    inputs = resolve_inputs(spec, need_experts=False)
    family = inputs.family
    for repair in repairs:
        try:
            if repair.name in MODULE_REPAIRS:
                check_surgery_family(family, repair)
            elif repair.name == "lot":
                check_lot_family(family)
        except InvalidParameterError as exc:  # worded for --method; here the repair is named by --repair
            raise InvalidParameterError("repair", exc.value, exc.expected) from None
    if any(repair.uses_data for repair in repairs):
        validate_datasets(
            family, inputs.tasks, ("train",), calibration_examples=spec.featcal.num_calibration_examples,
            allow_fewer=spec.allow_fewer_calibration_examples, seed=spec.seed,
            preprocessor=family.preprocessor(inputs.base_folder),
        )  # fmt: skip
    return compared


def option_flags(spec: RunSpec, names: Sequence[str]) -> list[str]:
    """The flags that give ``featcal calibrate`` the run's values of the options ``names`` (those not at their
    defaults), as the command line spells them."""
    from featcal.calibration.params import FeatCalParams

    argv: list[str] = []
    for f, _, owner in option_fields(RunSpec):
        if f.name not in names:
            continue
        value = getattr(spec.featcal if owner is FeatCalParams else spec, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if value == default or value is None:
            continue
        flag = f"--{flag_name(f)}"
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            for key, item in value.items():
                argv += [flag, f"{key}={item}"]
        else:
            argv += [flag, str(value)]
    return argv


def read_options(repair: Repair) -> list[str]:
    """The run options ``featcal calibrate --method`` reads for ``repair`` (FeatCal: every FeatCal parameter)."""
    from featcal.calibration.params import GROUP as FEATCAL_GROUP
    from featcal.options import option_of

    if not repair.uses_data:
        return list(DATA_FREE)
    groups = (TASKS, RUNTIME, FEATCAL_GROUP) if repair.name == DEFAULT_REPAIR else (TASKS, RUNTIME)
    names = [f.name for f, _, _ in option_fields(RunSpec) if option_of(f).group in groups]  # type: ignore[union-attr]
    return [*names, *CALIBRATION_DRAW, "output_dtype"]


def repair_command(
    spec: RunSpec, repair: Repair, merged: Path, output: Path, setting: Mapping[str, Any] | None = None
) -> list[str]:
    """The repair's command line: ``featcal -q calibrate --method NAME --merged DIR --output DIR`` with the
    hyper-parameters ``setting`` (``--repair-param KEY=VALUE``; FeatCal's in place of the run's values of its
    parameters) and the run's options the repair reads (without the program's name)."""
    setting = dict(setting or {})
    if repair.name == DEFAULT_REPAIR and setting:
        spec = spec.replace(featcal=dataclasses.replace(spec.featcal, **setting))
    own = [] if repair.name == DEFAULT_REPAIR else setting.items()
    params = [arg for key, value in own for arg in ("--repair-param", f"{key}={shown_value(value)}")]
    flags = option_flags(spec, [name for name in read_options(repair) if repair.uses_data or name not in NOT_READ])
    return ["-q", "calibrate", "--method", repair.name, "--merged", str(merged), "--output", str(output), *params,
            *flags]  # fmt: skip


def measure_child(args: Sequence[str], *, what: str) -> ChildCost:
    """Run ``featcal args ...`` (no ``args``: only the imports) in a child process to its end: its wall time,
    measured here, and its own peak RSS, which it reports itself (:mod:`featcal.repairs.measured`).

    Raises:
        FeatcalError: naming ``what`` and the child's last line of error output when it fails.
    """
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as errors:
        report = Path(tmp) / "peak.json"
        argv = [sys.executable, "-m", "featcal.repairs.measured", str(report), *args]
        start = time.perf_counter()
        status = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=errors, check=False).returncode
        seconds = time.perf_counter() - start
        if status != 0 or not report.is_file():
            errors.seek(0)
            lines = [line for line in errors.read().decode(errors="replace").splitlines() if line.strip()]
            raise FeatcalError(f"{what} failed: {lines[-1] if lines else f'exit status {status}'}")
        peak = json.loads(report.read_text())["peak_rss_bytes"]
    return ChildCost(seconds, int(peak))


def measure_floor() -> ChildCost:
    """The cost of a child that only imports what every repair's command imports (torch, transformers, featcal)."""
    return measure_child([], what="The import floor of the repair processes")


def result_identity(
    run_id: str, merged_weights: Mapping[str, str], argv: Sequence[str], defaults: Mapping[str, Any]
) -> str:
    """What a repair's result was computed from: the run, the merged weights, the repair's command and its
    hyper-parameters' defaults (the command names only the values an entry sets, so a changed default, such as
    LOT's ``norms``, redoes a result computed with the old one)."""
    from featcal.fingerprints import digest
    from featcal.version import __version__

    return digest(
        "repair-comparison", COMPARISON_VERSION, __version__, run_id, dict(merged_weights), list(argv), dict(defaults)
    )


def compare_repairs(
    spec: RunSpec,
    compared: Sequence[ComparedRepair],
    run_dir: Path,
    merged: Path,
    evaluate: Callable[[Repair, Path], dict[str, Any]],
    *,
    redo: bool = False,
) -> tuple[list[dict[str, Any]], bool]:
    """Run every entry's repair on ``merged`` in a child process, evaluate its output, and write its result file
    (``<entry's stem>.json``, :attr:`ComparedRepair.stem`); a result whose identity is unchanged is kept.

    Args:
        spec: The run (the options each child reads).
        compared: The entries (repairs with their hyper-parameters), in order.
        run_dir: The run folder.
        merged: The merged model folder the repairs start from.
        evaluate: ``evaluate(repair, output)``: the repair's ``metrics.json``-style report.
        redo: Redo every repair, even one whose result is up to date (``--force``).

    Returns:
        Each entry's result, in order, and whether any was computed now.

    Raises:
        FeatcalError: when a repair's process fails.
    """
    from featcal.files.atomic import atomic_write_json
    from featcal.files.reading import read_json
    from featcal.metrics import weights_sha256
    from featcal.runfolder.layout import RUN_CONFIG
    from featcal.runfolder.record import read_run_config

    run_id = read_run_config(run_dir / RUN_CONFIG, f"Run folder {run_dir}").recipe_sha256
    folder = run_dir / REPAIRS_DIR
    folder.mkdir(exist_ok=True)
    merged_weights = weights_sha256(merged)
    floor: ChildCost | None = None
    results, computed = [], False
    for entry in compared:
        repair = entry.repair
        output, record = folder / entry.stem, folder / f"{entry.stem}.json"
        argv = repair_command(spec, repair, merged, output, entry.setting)
        identity = result_identity(run_id, merged_weights, argv, repair.defaults)
        kept = read_json(record) if record.is_file() else None
        if not redo and isinstance(kept, dict) and kept.get("identity") == identity and output.is_dir():
            results.append(kept)
            continue
        record.unlink(missing_ok=True)
        shutil.rmtree(output, ignore_errors=True)
        floor = floor or measure_floor()
        cost = measure_child(argv, what=f"The {entry.label} repair of the comparison")
        result = {
            "repair": repair.name, "pretty_name": repair.pretty_name, "releasable": repair.releasable,
            "uses_data": repair.uses_data, "params": _recorded_params(output), "run_id": run_id,
            "identity": identity, "seconds": cost.seconds, "peak_rss_bytes": cost.peak_rss_bytes,
            "floor": dataclasses.asdict(floor), "threads": spec.threads,
            "metrics": evaluate(repair, output), **_own_report(repair, output),
            **({"setting": dict(entry.setting)} if entry.setting else {}),  # an entry without one: as before
        }  # fmt: skip
        atomic_write_json(record, result)
        results.append(result)
        computed = True
    return results, computed


def _recorded_params(output: Path) -> dict[str, Any]:
    """The hyper-parameters (and calibration draw) the repair's output folder records; FeatCal's from its
    recipe's FeatCal section."""
    from featcal.model_recipe import read_model_recipe

    recipe = read_model_recipe(output)
    if recipe is None:
        return {}
    if recipe.featcal is not None:
        return recipe.featcal.to_json()
    return dict(recipe.repairs[-1].get("params", {})) if recipe.repairs else {}


def _own_report(repair: Repair, output: Path) -> dict[str, Any]:
    """What a module repair measured of itself: the seconds of its embeddings and training alone, kept beside
    the process's own figures. (Its report's peak memory is left out: it is the same process's high-water mark,
    read before the output is written, so at most the ``peak_rss_bytes`` its process reports.)"""
    from featcal.files.reading import read_json

    if repair.name not in MODULE_REPAIRS:
        return {}
    from featcal.repairs.surgery_run import report_file

    return {"own_seconds": read_json(output / report_file(repair))["seconds"]}
