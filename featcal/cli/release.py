"""`featcal export`, `featcal card` and `featcal push`: parse, call featcal.release, print."""

from __future__ import annotations

import argparse

from featcal.cli.common import path_line
from featcal.cli.options import add_options, command, given_values
from featcal.cli.tables import file_table
from featcal.hub.options import HubOptions
from featcal.release.options import CardOptions, CommitOptions


def run_export(args: argparse.Namespace) -> int:
    from featcal.release.export import export_release
    from featcal.repairs.surgery_run import check_releasable

    check_releasable(args.run_dir)  # a Representation Surgery or ProbSurgery output holds no model

    given = given_values(args, CardOptions)
    card = CardOptions(**given)
    out = export_release(
        args.run_dir, args.output, repo_id=card.repo_id, license=given.get("license"), template=card.template
    )
    print(path_line("Release folder", out))
    return 0


def run_card(args: argparse.Namespace) -> int:
    from featcal.release.card import write_card

    given = given_values(args, CardOptions)
    card = CardOptions(**given)
    path = write_card(
        args.run_dir, args.output, repo_id=card.repo_id, license=given.get("license"), template=card.template
    )
    print(path_line("Model card", path))
    return 0


def run_push(args: argparse.Namespace) -> int:
    from featcal.release.push import push_release
    from featcal.repairs.surgery_run import check_releasable

    check_releasable(args.path)  # a Representation Surgery or ProbSurgery output holds no model

    hub, commit = HubOptions(**given_values(args, HubOptions)), CommitOptions(**given_values(args, CommitOptions))
    result = push_release(
        args.path,
        hub.repo_id,
        private=hub.private,
        revision=commit.revision,
        create_pr=commit.create_pr,
        commit_message=commit.commit_message,
        token=hub.token,
        dry_run=hub.dry_run,
        endpoint=hub.endpoint,
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
    """Add the `export`, `card` and `push` subcommands, each with its handler."""
    export = subparsers.add_parser("export", help="write a run's release folder (weights, card, metrics, recipe)")
    export.add_argument(
        "run_dir", metavar="RUN", help="run folder (with run_config.json), or a model folder of featcal merge/calibrate"
    )
    export.add_argument(
        "--output", metavar="DIR", help="release folder (default: RUN/release; for a model folder DIR, DIR-release)"
    )
    add_options(export, CardOptions)
    command(export, run_export)

    card = subparsers.add_parser("card", help="regenerate only the model card (README.md and plot) of a run")
    card.add_argument(
        "run_dir", metavar="RUN", help="run folder (with run_config.json), or a model folder of featcal merge/calibrate"
    )
    card.add_argument(
        "--output", metavar="DIR", help="folder for README.md and the plot (default: RUN/release, or DIR-release)"
    )
    add_options(card, CardOptions)
    command(card, run_card)

    push = subparsers.add_parser("push", help="upload a release to the Hugging Face Hub")
    push.add_argument("path", metavar="FOLDER", help="release folder, or run folder (its release/ is used or exported)")
    add_options(push, HubOptions, required=("repo_id",))
    add_options(push, CommitOptions)
    command(push, run_push)
