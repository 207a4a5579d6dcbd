"""`featcal export`, `featcal card` and `featcal push`: parse, call featcal.release, print."""

from __future__ import annotations

import argparse

from featcal.cli.common import path_line
from featcal.cli.tables import file_table
from featcal.release.options import DEFAULT_LICENSE


def _add_card_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", metavar="ID", help="Hub repository the card names (namespace/name)")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help=f"license in the card (default: {DEFAULT_LICENSE})")
    parser.add_argument("--template", metavar="FILE", help="your own Jinja model card template")


def run_export(args: argparse.Namespace) -> int:
    from featcal.release import export_release

    out = export_release(args.run_dir, args.output, repo_id=args.repo, license=args.license, template=args.template)
    print(path_line("Release folder", out))
    return 0


def run_card(args: argparse.Namespace) -> int:
    from featcal.release import write_card

    card = write_card(args.run_dir, args.output, repo_id=args.repo, license=args.license, template=args.template)
    print(path_line("Model card", card))
    return 0


def run_push(args: argparse.Namespace) -> int:
    from featcal.release import push_release

    result = push_release(
        args.path,
        args.repo,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        token=args.token,
        dry_run=args.dry_run,
        endpoint=args.endpoint,
    )
    if result.dry_run:
        print(f"Dry run: would upload {result.folder.resolve()} to {result.repo_id}:\n{file_table(result.files)}")
        return 0
    if not result.changed:
        print(f"{result.repo_id} already holds this release: nothing to commit.")
    print(f"Commit: {result.commit_url}")
    if result.pr_url:
        print(f"Pull request: {result.pr_url}")
    print(f"Checked {len(result.files)} files on the Hub: sizes and hashes match.")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export`, `card` and `push` subcommands, each with ``func`` set to its handler."""
    export = subparsers.add_parser("export", help="write a run's release folder (weights, card, metrics, recipe)")
    export.add_argument("run_dir", metavar="RUN", help="run folder (with run_config.json)")
    export.add_argument("--output", metavar="DIR", help="release folder (default: RUN/release)")
    _add_card_options(export)
    export.set_defaults(func=run_export)

    card = subparsers.add_parser("card", help="regenerate only the model card (README.md and plot) of a run")
    card.add_argument("run_dir", metavar="RUN", help="run folder (with run_config.json)")
    card.add_argument("--output", metavar="DIR", help="folder for README.md and the plot (default: RUN/release)")
    _add_card_options(card)
    card.set_defaults(func=run_card)

    push = subparsers.add_parser("push", help="upload a release to the Hugging Face Hub as one commit")
    push.add_argument("path", metavar="FOLDER", help="release folder, or run folder (its release/ is used or exported)")
    push.add_argument("--repo", required=True, metavar="ID", help="Hub repository, namespace/name")
    push.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    push.add_argument("--revision", metavar="BRANCH", help="branch to commit to (created if missing)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    push.add_argument("--commit-message", metavar="MSG", help="commit title")
    push.add_argument("--token", help="Hub token (default: HF_TOKEN, then the stored login); never printed")
    push.add_argument("--dry-run", action="store_true", help="list what would be uploaded; do not contact the Hub")
    push.add_argument("--endpoint", metavar="URL", help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    push.set_defaults(func=run_push)
