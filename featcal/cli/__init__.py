"""The `featcal` command: parse, call the library, print. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import NoReturn

from featcal import progress
from featcal.allocator import keep_freed_memory_for_reuse
from featcal.cli import processes
from featcal.distributed import launched as launched_world
from featcal.errors import DistributedError, FeatcalError
from featcal.version import __version__

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"

# Modules that add subcommands; each has `register(subparsers)`. The families' own commands (`featcal
# architectures`) come after them, from the registry (featcal.families.command_modules).
COMMAND_MODULES = (
    "featcal.cli.pipeline_commands",
    "featcal.cli.suites",
    "featcal.cli.diagnose",
    "featcal.cli.sweep",
    "featcal.cli.release",
    "featcal.cli.space",
    "featcal.cli.demo",
    "featcal.cli.code_eval",
    "featcal.cli.compare",
)


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``featcal: error: …``, like featcal's own (exit 2),
    pointing at ``--help`` instead of printing the usage; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"featcal: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineErrorParser(
        prog="featcal",
        description="Merge task experts, calibrate the merge with FeatCal, evaluate it zero-shot and release it.",
    )
    parser.add_argument("--version", action="version", version=f"featcal {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="featcal's debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from featcal.families import command_modules

    for name in (*COMMAND_MODULES, *command_modules()):
        importlib.import_module(name).register(subparsers)
    return parser


def _configure_output(quiet: bool, verbose: bool) -> None:
    """Log levels and progress display for one command.

    featcal's own loggers log at INFO (DEBUG with ``-v``, WARNING with ``-q``); every other library
    at WARNING whatever the flags. ``-q`` also silences transformers' warnings and turns the
    progress bars of huggingface_hub, datasets and transformers off, as does a stderr that is not a
    terminal: their carriage returns would garble a log file.
    """
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("featcal").setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    if quiet or not progress.is_interactive():
        _library_bars_off()
    if quiet:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()


def _library_bars_off() -> None:
    """Turn off the progress bars of huggingface_hub, datasets and transformers.

    Through the environment variables they read when imported, so that nothing is imported here
    (transformers follows huggingface_hub's); a library already imported is told directly.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _progress_display(quiet: bool) -> contextlib.AbstractContextManager:
    """Around the command: with ``-q`` no featcal progress; on a terminal, log lines written above the bars."""
    if quiet:
        return progress.disabled()
    if not progress.is_interactive():
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


@contextlib.contextmanager
def _stop_requests_end_cleanly() -> Iterator[None]:
    """A stop request (SIGTERM: ``kill``, torchrun stopping its other processes, a scheduler's
    preemption) ends the command like an error, so its temporary files and folders are removed on the
    way out (exit status 143); a second one while that clean-up runs is ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_stop_request)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_stop_request(signum: int, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _secrets(args: argparse.Namespace) -> list[str | None]:
    """The token values an error message must not show: the one given with ``--token`` and the environment's."""
    return [getattr(args, "token", None), os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `featcal` console script; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    rank, size = launched_world()
    if rank != 0:  # under torchrun rank 0 alone logs, shows progress and prints results
        processes.silence()
    quiet = args.quiet or rank != 0
    _configure_output(quiet, args.verbose)
    keep_freed_memory_for_reuse()
    try:
        if size > 1 and args.command not in processes.DISTRIBUTED_COMMANDS:
            raise FeatcalError(
                f"featcal {args.command} runs in one process: start it without torchrun (torchrun runs "
                f"{', '.join(processes.DISTRIBUTED_COMMANDS)})."
            )
        with _progress_display(quiet), _stop_requests_end_cleanly():
            return int(args.func(args) or 0)
    except FeatcalError as exc:
        from featcal.cli.errors import hide_secrets, word_error

        defer = rank != 0 or isinstance(exc, DistributedError)
        message = word_error(exc, getattr(args, "flags", None))
        processes.print_error(hide_secrets(message, _secrets(args)), rank, size, defer=defer)
        return 2
    except OSError as exc:
        from featcal.cli.errors import file_error, hide_secrets

        message = file_error(exc)
        if message is None:
            raise
        processes.print_error(hide_secrets(message, _secrets(args)), rank, size, defer=rank != 0)
        return 2
    except KeyboardInterrupt:
        print("featcal: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if size == 1:
            raise
        if args.verbose:
            traceback.print_exc()
        processes.print_error(f"{type(exc).__name__}: {exc}", rank, size, defer=rank != 0)
        return 1
