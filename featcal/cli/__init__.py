"""The `featcal` command: parse, call the library, print. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from featcal import __version__
from featcal.errors import FeatcalError

# Modules that add subcommands; each has `register(subparsers)`.
COMMAND_MODULES = ("featcal.cli.pipeline_commands", "featcal.cli.release", "featcal.cli.space", "featcal.cli.demo")


# The parameters of the publishing API (push_release, push_space, export_release, render_card) that
# `featcal push`, `featcal space push`, `featcal export` and `featcal card` set from a flag.
def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="featcal",
        description="Merge task experts, calibrate the merge with FeatCal, evaluate it zero-shot and release it.",
    )
    parser.add_argument("--version", action="version", version=f"featcal {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _configure_logging(quiet: bool, verbose: bool) -> None:
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    if quiet:
        import datasets
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `featcal` console script; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    _configure_logging(args.quiet, args.verbose)
    try:
        return int(args.func(args) or 0)
    except FeatcalError as exc:
        from featcal.cli.errors import word_error

        print(f"featcal: error: {word_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("featcal: interrupted", file=sys.stderr)
        return 130
