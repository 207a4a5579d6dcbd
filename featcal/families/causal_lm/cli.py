"""The causal-LM family's command, ``featcal architectures``: which causal-LM architectures of the installed
transformers featcal calibrates (added to the CLI through the registry, :func:`featcal.families.command_modules`)."""

from __future__ import annotations

import argparse

from featcal.cli.options import command


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "architectures",
        help="list the causal-LM architectures of the installed transformers: calibrated, or refused and why",
    )
    parser.add_argument(
        "--recorded",
        action="store_true",
        help="print the list featcal records (architectures.json) instead of probing each architecture (minutes)",
    )
    command(parser, cmd_architectures)


def cmd_architectures(args: argparse.Namespace) -> int:
    from featcal.families.causal_lm.architectures import known, table
    from featcal.families.causal_lm.survey import installed

    print(table(list(known().values()) if args.recorded else installed()))
    return 0
