"""`featcal space` (launch the Gradio Space locally) and `featcal space push` (publish it)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from featcal.cli.common import path_line, show_progress
from featcal.cli.options import add_options, command, given_values
from featcal.cli.tables import file_table
from featcal.hub.options import HubOptions
from featcal.space.options import SpacePushOptions, SpaceServeOptions


def _check_address(host: str, port: int | None) -> None:
    """Refuse a host that is not an address of this machine, or a port in use, before the model loads
    (a port outside 1–65535 is refused by its option).

    Raises:
        FeatcalError: naming the option and the fix.
    """
    import socket

    from featcal.errors import FeatcalError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port or 0))
        except (OSError, OverflowError) as exc:
            what = f"--host {host}" + (f" --port {port}" if port else "")
            raise FeatcalError(
                f"Cannot serve on {what} ({exc.strerror or exc}): choose a free port, or an address of this machine."
            ) from None


def cmd_space(args: argparse.Namespace) -> int:
    from featcal.space import SpaceSettings, create_space

    options = SpaceServeOptions(**given_values(args, SpaceServeOptions))
    _check_address(options.host, options.port)
    settings = SpaceSettings(
        model_id=options.model_id,
        base_model_id=options.base_model_id,
        tasks_file=options.tasks_file,
        suite=options.suite,
        app_dir=Path.cwd(),
        device=options.device,
    )
    space = create_space(settings, progress=show_progress(args))
    # A stop request (SIGTERM, as from `docker stop` or a Space restart) ends the launch as it ends any
    # command (featcal.cli.main), so the server is closed and the temporary example folder removed.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        space.launch(host=options.host, port=options.port, share=options.share)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second stop request waits for the clean-up
        try:
            space.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from featcal.space.publish import push_space

    hub, space = HubOptions(**given_values(args, HubOptions)), SpacePushOptions(**given_values(args, SpacePushOptions))
    result = push_space(
        hub.repo_id,
        model_id=space.model_id,
        base_model_id=space.base_model_id,
        tasks_file=space.tasks_file,
        suite=space.suite,
        private=hub.private,
        token=hub.token,
        dry_run=hub.dry_run,
        endpoint=hub.endpoint,
        output=space.output,
        examples=not space.no_examples,
        progress=show_progress(args),
    )
    if result.dry_run:
        print(f"Dry run: would upload to the Space {result.repo_id}:\n{file_table(result.files)}")
    else:
        print(
            f"Space: {result.space_url}\nCommit: {result.commit_url}\n{len(result.files)} files uploaded; "
            "the Space builds and starts in a few minutes."
        )
    if result.folder:
        print(path_line("Staged folder", result.folder))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `space` (local launch) with its `push` subcommand."""
    space = subparsers.add_parser(
        "space",
        help="launch the Gradio Space locally, or publish it with `featcal space push`",
        description="Launch the zero-shot classification Space against a run, release or model folder (or Hub id).",
    )
    add_options(space, SpaceServeOptions)
    command(space, cmd_space)

    actions = space.add_subparsers(dest="space_command", metavar="[push]", title="publish instead of launching")
    push = actions.add_parser(
        "push",
        help="publish the Space on the Hugging Face Hub",
        description="Stage the Space's files (app, requirements, card, the featcal modules the app imports, "
        "examples, space_config.json naming the model) and upload them in one commit.",
    )
    add_options(
        push,
        HubOptions,
        required=("repo_id",),
        helps={
            "repo_id": "Space repository, namespace/name",
            "private": "create the Space private (if it is new)",
            "dry_run": "stage and list the files; do not contact the Hub",
        },
    )
    add_options(push, SpacePushOptions)
    command(push, cmd_push)
