"""`featcal compare RUN`: the table of the repairs a run compared (`featcal run --repair NAME ...`)."""

from __future__ import annotations

import argparse

from featcal.cli.options import command


def cmd_compare(args: argparse.Namespace) -> int:
    from featcal.repairs.compare_table import comparison_text

    print(comparison_text(args.run_dir))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `compare` subcommand, with ``func`` set to its handler."""
    p = subparsers.add_parser(
        "compare",
        help="the table of the repairs a run compared (featcal run --repair): accuracy per task, time, peak RSS",
        description="Print the merge's and each compared repair's score per task and average, the wall time and "
        "peak RSS of the repair's own process, and whether its result is releasable (docs/repairs.md).",
    )
    p.add_argument("run_dir", metavar="RUN", help="run folder of `featcal run ... --repair NAME ...`")
    command(p, cmd_compare)
