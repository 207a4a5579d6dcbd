"""`featcal sweep`: parse, call :func:`featcal.sweep.runner.run_sweep`, print the curve as a table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from featcal.cli.common import path_line, show_progress
from featcal.cli.options import add_options, add_spec_options, command, given_values

# The run options `featcal sweep` takes; everything else comes from the run folder's run_config.json.
SWEEP_RUN_OPTIONS = (
    "cache_dir",
    "eval_batch_size",
    "eval_num_workers",
    "device",
    "precision",
    "threads",
    "allow_fewer_calibration_examples",
)


def format_sweep(report) -> str:
    """One row per task and the average, one column per setting (and the merged model), in %."""
    columns = [(f"{report.merged_model} (n=0)", report.merged)] if report.merged is not None else []
    columns += [(report.label(point), point) for point in report.points]
    width = max([len(t) for t in report.tasks] + [7])
    cell = max(9, *(len(label) for label, _ in columns))
    lines = [f"{'task':<{width}}  " + "  ".join(f"{label:>{cell}}" for label, _ in columns)]
    for task in [*report.tasks, "average"]:
        values = [point.average if task == "average" else point.tasks[task] for _, point in columns]
        lines.append(f"{task:<{width}}  " + "  ".join(f"{100 * v:>{cell}.2f}" for v in values))
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    from featcal.outputs import check_output_folder
    from featcal.spec import build_spec
    from featcal.sweep.report import SWEEP_DIR, SWEEP_FILE, SWEEP_PLOT
    from featcal.sweep.request import SweepFlags, SweepRequest

    flags = SweepFlags(**given_values(args, SweepFlags))
    request = SweepRequest.parse(flags.sizes, flags.param, flags.together)
    spec = build_spec(cli=given_values(args), progress=show_progress(args))
    sweep_files = re.compile(f"{re.escape(SWEEP_FILE)}|{re.escape(SWEEP_PLOT)}")
    check_output_folder(Path(args.run_dir) / SWEEP_DIR, kind="sweep", allowed=sweep_files)

    from featcal.sweep.runner import run_sweep

    report = run_sweep(args.run_dir, spec, request)
    print(format_sweep(report))
    folder = Path(args.run_dir) / SWEEP_DIR
    print(path_line("Sweep", folder / SWEEP_FILE))
    if (folder / SWEEP_PLOT).is_file():
        print(path_line("Plot", folder / SWEEP_PLOT))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `sweep`, with its handler."""
    from featcal.sweep.request import SweepFlags

    p = subparsers.add_parser(
        "sweep",
        help="FeatCal's accuracy against the calibration size n (or λ, ρ, α, ε) on a run's merged model",
        description="Calibrate a run's merged model with FeatCal for several calibration sizes n (and values of "
        "one FeatCal parameter), evaluate each zero-shot and write the curve into RUN_DIR/sweep/ (sweep.json, "
        "sweep.png). The run's own FeatCal parameters, seed and evaluation are kept; the calibration subsets "
        "are nested (the first n images of one seeded shuffle) and the settings are calibrated together.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `featcal run` (with its merged model)")
    add_options(p, SweepFlags)
    add_spec_options(p, only=SWEEP_RUN_OPTIONS)
    command(p, cmd_sweep)
