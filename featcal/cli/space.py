"""`featcal space` (launch the Gradio Space locally) and `featcal space push` (publish it)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from featcal.cli.common import path_line, show_progress
from featcal.cli.tables import file_table
from featcal.space.settings import DEFAULT_MODEL_ID
from featcal.suites import SUITE_NAMES

SUITE_HELP = "built-in suite whose tasks to offer (default: the model's run_config.json's, else ta8)"


def _check_address(host: str, port: int | None) -> None:
    """Refuse a port outside 1–65535, a host that is not an address of this machine, or a port in use,
    before the model loads.

    Raises:
        FeatcalError: naming the option and the fix.
    """
    import socket

    from featcal.errors import FeatcalError

    if port is not None and not 1 <= port <= 65535:
        raise FeatcalError(f"--port {port} is invalid: it must be a port number from 1 to 65535.")
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

    _check_address(args.host, args.port)
    settings = SpaceSettings(
        model_id=args.model,
        base_model_id=args.base_model_id,
        tasks_file=args.tasks_file,
        suite=args.suite,
        app_dir=Path.cwd(),
        device=args.device,
    )
    space = create_space(settings, progress=show_progress(args))
    # A stop request (SIGTERM, as from `docker stop` or a Space restart) ends the launch as it ends any
    # command (featcal.cli.main), so the server is closed and the temporary example folder removed.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        space.launch(host=args.host, port=args.port, share=args.share)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second stop request waits for the clean-up
        try:
            space.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from featcal.space.publish import push_space

    result = push_space(
        args.repo,
        model_id=args.model_id,
        base_model_id=args.base_model_id,
        tasks_file=args.tasks_file,
        suite=args.suite,
        private=args.private,
        token=args.token,
        dry_run=args.dry_run,
        endpoint=args.endpoint,
        output=args.output,
        examples=not args.no_examples,
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
    space.add_argument(
        "--model",
        "--model-id",
        default=DEFAULT_MODEL_ID,
        metavar="DIR_OR_ID",
        help="run folder (its release/ or featcal-*/), release or model folder, or Hub id "
        f"(default {DEFAULT_MODEL_ID})",
    )
    space.add_argument(
        "--base-model-id",
        default=None,
        metavar="ID_OR_DIR",
        help="base CLIPModel for the text tower (default: the run's, else openai/clip-vit-base-patch32)",
    )
    space.add_argument(
        "--tasks-file",
        default=None,
        metavar="FILE",
        help="JSON or YAML task table to offer instead of the built-in suite's tasks",
    )
    space.add_argument("--suite", choices=SUITE_NAMES, default=None, help=SUITE_HELP)
    space.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; 0.0.0.0 for all)")
    space.add_argument("--port", type=int, default=None, help="port (default: Gradio's, 7860 or the next free one)")
    space.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    space.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    space.set_defaults(func=cmd_space)

    actions = space.add_subparsers(dest="space_command", metavar="[push]", title="publish instead of launching")
    push = actions.add_parser(
        "push",
        help="publish the Space on the Hugging Face Hub",
        description="Stage the Space's files (app, requirements, card, featcal package, "
        "examples, space_config.json naming the model) and upload them as one commit.",
    )
    push.add_argument("--repo", required=True, metavar="ID", help="Space repository, namespace/name")
    push.add_argument(
        "--model-id",
        default=DEFAULT_MODEL_ID,
        metavar="ID",
        help=f"Hub model the Space loads, written to space_config.json (default {DEFAULT_MODEL_ID})",
    )
    push.add_argument(
        "--base-model-id",
        default=None,
        metavar="ID",
        help="base CLIP on the Hub (default: the model's run_config.json, else openai/clip-vit-base-patch32)",
    )
    push.add_argument(
        "--tasks-file",
        default=None,
        metavar="FILE",
        help="task table to ship with the Space instead of the built-in suite's tasks",
    )
    push.add_argument("--suite", choices=SUITE_NAMES, default=None, help=SUITE_HELP)
    push.add_argument("--private", action="store_true", help="create the Space private (if it is new)")
    push.add_argument("--token", help="Hub token (default: HF_TOKEN, then the stored login); never printed")
    push.add_argument("--dry-run", action="store_true", help="stage and list the files; do not contact the Hub")
    push.add_argument("--output", metavar="DIR", help="stage the Space in DIR (new or empty) and keep it")
    push.add_argument(
        "--no-examples", action="store_true", help="ship no example images (else one per task, from its test split)"
    )
    push.add_argument("--endpoint", metavar="URL", help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    push.set_defaults(func=cmd_push)
