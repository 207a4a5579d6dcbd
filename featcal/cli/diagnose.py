"""`featcal diagnose RUN`: the feature drift of a run's models from its experts, into the run folder."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from featcal.cli.common import path_line, show_progress
from featcal.cli.options import add_spec_options, command, given_values
from featcal.spec import DIAGNOSTICS, RUNTIME, build_spec

if TYPE_CHECKING:
    from featcal.diagnostics.report import DriftReport

RENAMED = {"diagnose_split": "--split", "diagnose_images": "--num-images"}  # the flags of `featcal run` here


def drift_table(report: DriftReport, *, column: int = 16) -> str:
    """A plain-text table: one row per measuring point, one column per model, the mean drift over tasks."""
    d = report.drift
    width = max(len(p) for p in [*d.points, "mean of layers"])
    labels = [report.labels[m] for m in d.models]
    column = max([column, *(len(label) for label in labels)])
    lines = [f"{'point':<{width}}  " + "  ".join(f"{label:>{column}}" for label in labels)]
    for index, point in enumerate(d.points):
        cells = [sum(d.drift[m][t][index] for t in d.tasks) / len(d.tasks) for m in d.models]
        lines.append(f"{point:<{width}}  " + "  ".join(f"{v:>{column}.4f}" for v in cells))
    means = [d.mean_layer_drift(m) for m in d.models]
    lines.append(f"{'mean of layers':<{width}}  " + "  ".join(f"{v:>{column}.4f}" for v in means))
    return "\n".join(lines)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from featcal.diagnostics.run import diagnose_run
    from featcal.runfolder.layout import RELEASE_DIR

    spec = build_spec(cli=given_values(args), progress=show_progress(args))
    report, path, plot = diagnose_run(args.run_dir, spec)
    print(drift_table(report))
    print(report.summary())
    print(path_line("Diagnostics", path))
    if plot is not None:
        print(path_line("Plot", plot))
    if (path.parent / RELEASE_DIR).is_dir():
        print(f"Run `featcal export {args.run_dir}` to show them in the release's model card.")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `diagnose` subcommand, with ``func`` set to its handler."""
    p = subparsers.add_parser(
        "diagnose",
        help="feature drift of a run's merged and calibrated models from the experts, per layer and task",
        description="Measure, per encoder layer and task, how far the merged model's features (before FeatCal) "
        "and the calibrated model's (after) lie from each task's expert on the same images; writes "
        "RUN/diagnostics.json and RUN/diagnostics.png.",
    )
    p.add_argument("run_dir", metavar="RUN", help="run folder (with run_config.json and ta/, featcal-ta/, …)")
    add_spec_options(
        p,
        groups=(DIAGNOSTICS, RUNTIME),
        exclude=("seed", "dist_timeout"),  # one process: torchrun is refused
        renamed=RENAMED,
    )
    command(p, cmd_diagnose)
