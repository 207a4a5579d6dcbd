"""Publish a release folder to the Hugging Face Hub, then check what the Hub lists.

Nothing reaches the Hub before the folder has been checked (:func:`~featcal.release.check.check_release`), the token has
been found and accepted, and the repository's namespace is the token owner's or one of their
organisations'. The token is passed to ``huggingface_hub`` and never logged or put in a message.

A release is sent as one commit. A large one (more than :data:`LARGE_UPLOAD_BYTES` bytes or
:data:`LARGE_UPLOAD_FILES` files: a language model of billions of parameters) goes through
``HfApi.upload_folder``, which with Xet storage (``hf_xet``) uploads in a streamed pipeline that can
split the upload into several commits and resumes an interrupted upload when run again; without Xet it
makes the same single commit.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import RepositoryNotFoundError

from featcal.errors import ReleaseError
from featcal.files.model_files import WEIGHTS, WEIGHTS_INDEX
from featcal.hub.publishing import HIDDEN_PATTERNS, hub_api, publishing
from featcal.hub.refs import check_repo_id
from featcal.hub.verification import HubFile, hub_files, verify_hub_files
from featcal.metrics import WEIGHTS_SHA256
from featcal.outputs import enclosing_run
from featcal.release.card_template import CARD_FILE
from featcal.release.check import Release, check_release
from featcal.release.export import export_release
from featcal.release.manifest import read_manifest
from featcal.release.model_folder import default_release_folder, is_model_folder, is_model_release
from featcal.runfolder.layout import RELEASE_DIR, RUN_CONFIG
from featcal.runfolder.ledger import StageLedger
from featcal.runfolder.lock import RunLock
from featcal.version import __version__

logger = logging.getLogger(__name__)

# A release above either goes through upload_folder (resumable, possibly several commits, with Xet).
LARGE_UPLOAD_BYTES = 5 * 10**9  # save_pretrained's shard size: more than one shard's worth
LARGE_UPLOAD_FILES = 50


def is_large(files: tuple[HubFile, ...]) -> bool:
    """Whether a release is large enough for the resumable upload: over :data:`LARGE_UPLOAD_BYTES` bytes
    or :data:`LARGE_UPLOAD_FILES` files."""
    return sum(f.size for f in files) > LARGE_UPLOAD_BYTES or len(files) > LARGE_UPLOAD_FILES


@dataclass(frozen=True)
class PushResult:
    """What a push did (or, for a dry run, would do)."""

    repo_id: str
    folder: Path
    files: tuple[HubFile, ...]
    dry_run: bool = False
    commit_url: str | None = None
    commit_oid: str | None = None
    pr_url: str | None = None
    changed: bool = False


def resolve_release_folder(folder: str | Path, repo_id: str, *, dry_run: bool = False) -> Path:
    """The release folder to push: ``folder`` itself, or the ``release/`` of a run folder.

    A run folder without a release yet is exported first, with its card naming ``repo_id``, unless this
    is a dry run, which writes nothing. An existing release is never modified: it is exactly what gets
    uploaded.

    Raises:
        ReleaseError: for a folder that is neither a release nor a run folder, or a dry run of a run folder
            that has no release yet.
    """
    path = Path(folder).expanduser()
    if _has_weights(path):
        return path
    if not (path / RUN_CONFIG).is_file():
        raise ReleaseError(
            path,
            f"{path} is neither a release folder (with {WEIGHTS}, {CARD_FILE}, metrics.json) nor a run folder "
            f"(with {RUN_CONFIG}): point at the output of `featcal run` or `featcal export`.",
        )
    release = path / RELEASE_DIR
    if not _has_weights(release):
        if dry_run:
            raise ReleaseError(
                path,
                f"{path} has no release yet, and a dry run writes nothing: export it first (`featcal export "
                f"{path}`), or push without --dry-run, which exports it.",
            )
        logger.info("No release in %s yet: exporting it", path)
        export_release(path, release, repo_id=repo_id)
    return release


def _has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a release's weights: one file, or (a language model's) a shard index."""
    return (folder / WEIGHTS).is_file() or (folder / WEIGHTS_INDEX).is_file()


def check_source(release: Path) -> None:
    """Refuse a release of a run folder whose released stage changed since the export: the stage's weights,
    as the run's ledger records them now, must be those the release's manifest says it copied.

    Raises:
        ReleaseError: naming the stage and the fix (export again).
    """
    run = enclosing_run(release.resolve())
    source = read_manifest(release).source
    if run is None or not source:
        return
    ledger = StageLedger.read(run, writes=False)
    stage = str(source.get("stage", ""))
    now = {
        path.removeprefix(f"{stage}/"): sha
        for entry in ledger.done.values()
        for path, (_, sha) in (entry.get("weights") or {}).items()
        if path.startswith(f"{stage}/")
    }
    if now and now != source.get(WEIGHTS_SHA256):  # a ledger without hashes (an older run) says nothing
        raise ReleaseError(
            release,
            f"{release} holds other weights than the run's {stage}/ holds now (the run was redone since the "
            f"export): export it again (`featcal export {run}`) before pushing.",
        )


def _ensure_repo(api: HfApi, repo_id: str, *, private: bool, revision: str | None) -> str | None:
    """Create the repository (and the branch) when missing; return the target revision's head commit."""
    try:
        info = api.repo_info(repo_id)
    except RepositoryNotFoundError:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = None
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = None
    return (info or api.repo_info(repo_id, revision=revision)).sha


def push_release(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
) -> PushResult:
    """Upload a release (or a run folder's release, exported if missing) to ``repo_id`` in one commit.

    Creates the repository (and the ``revision`` branch) when missing, commits every file of the
    folder, then lists the repository to check that each file arrived with the same size and hash.
    Pushing an unchanged folder makes no commit (``changed`` is False).

    Args:
        folder: A release folder, or a run folder (its ``release/`` is used, or exported first).
        repo_id: The model repository, ``namespace/name``, in the token owner's namespaces.
        private: Create the repository private (when it is new).
        revision: The branch to commit to (created when missing); default ``main``.
        create_pr: Open a pull request instead of committing to the branch.
        commit_message: The commit title (default names featcal's version and the recipe hash).
        token: A Hub token (default: ``HF_TOKEN``, then the stored login); never logged.
        dry_run: Check the folder and list the files, without contacting the Hub or writing anything.
        endpoint: The Hub endpoint (default: ``HF_ENDPOINT`` or huggingface.co).

    Returns:
        What was pushed (or would be, for a dry run): the files, the commit and pull-request URLs.

    Raises:
        InvalidParameterError: for a repository id without namespace or not valid on the Hub.
        ReleaseError: when the folder is not a complete, self-consistent release, or a run folder's release
            whose stage was redone since the export.
        RunLockedError: when another process is writing the run folder the release lies in.
        HubError: when the token is missing or refused, the Hub cannot be reached, offline mode is
            set, or the Hub lists files that differ from the ones sent.

    Example:
        >>> push_release("runs/ta8", "me/clip-vit-b32-ta8-featcal", private=True)  # doctest: +SKIP
    """
    check_repo_id(repo_id, namespace=True)
    options = dict(private=private, revision=revision, create_pr=create_pr, commit_message=commit_message,
                   token=token, dry_run=dry_run, endpoint=endpoint)  # fmt: skip
    path = Path(folder).expanduser()
    if is_model_folder(path):
        raise ReleaseError(
            path,
            f"{path} is a model folder, not a release: export it first (`featcal export {path}` writes "
            f"{default_release_folder(path)}), then push that folder.",
        )
    folder = resolve_release_folder(folder, repo_id, dry_run=dry_run)
    run = enclosing_run(folder.resolve())
    with RunLock(run, shared=True) if run is not None else nullcontext():  # no run rewrites it meanwhile
        release = check_release(folder)
        check_source(release.folder)
        return _push(release, repo_id, **options)


def _push(
    release: Release,
    repo_id: str,
    *,
    private: bool,
    revision: str | None,
    create_pr: bool,
    commit_message: str | None,
    token: str | None,
    dry_run: bool,
    endpoint: str | None,
) -> PushResult:
    """Push a checked release (see :func:`push_release`)."""
    if release.model_name != repo_id:
        logger.warning(
            "The card in %s was rendered for %r, not %s: its usage snippet names the wrong repository "
            "(re-render it with `featcal card %s --repo %s`).",
            release.folder,
            release.model_name,
            repo_id,
            "MODEL_FOLDER"
            if is_model_release(release.folder) and not enclosing_run(release.folder.resolve())
            else "RUN",
            repo_id,
        )
    if dry_run:
        return PushResult(repo_id=repo_id, folder=release.folder, files=release.files, dry_run=True)
    api = hub_api(token, endpoint, repo_id=repo_id)
    name = repo_id.split("/")[1]
    message = commit_message or f"Upload {name} (featcal {__version__}, recipe {release.recipe_sha256[:12]})"
    with publishing(api, repo_id):
        head = _ensure_repo(api, repo_id, private=private, revision=revision)
        if is_large(release.files) and not create_pr:  # a pull request is one commit: the path below
            logger.info("Uploading %s with upload_folder (resumable: run the push again if it stops)", release.folder)
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=release.folder,
                commit_message=message,
                revision=revision,
                allow_patterns=[f.path_in_repo for f in release.files],  # what was checked, nothing else
                ignore_patterns=list(HIDDEN_PATTERNS),
            )
        else:
            operations = [CommitOperationAdd(f.path_in_repo, f.local) for f in release.files]
            info = api.create_commit(
                repo_id, operations, commit_message=message, revision=revision, create_pr=create_pr
            )
        listed_revision = info.pr_revision or revision
        listed = hub_files(api, repo_id, revision=listed_revision)
    verify_hub_files(release.files, listed, repo_id=repo_id, revision=listed_revision, source="the release folder")
    logger.info("Pushed %s to %s: %s", release.folder, repo_id, info.commit_url)
    return PushResult(
        repo_id=repo_id,
        folder=release.folder,
        files=release.files,
        commit_url=info.commit_url,
        commit_oid=info.oid,
        pr_url=info.pr_url,
        changed=info.oid != head,
    )
