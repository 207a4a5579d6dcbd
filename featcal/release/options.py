"""What a release's model card says of its publication: the repository it names, its license, its
template (``featcal export`` and ``featcal card`` take these as flags). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass

from featcal.options import option, validate

DEFAULT_LICENSE = "mit"  # the license of OpenAI's CLIP weights, which the CLIP suites' base models carry
NO_LICENSE = "other"  # the card's license when none was given and the family claims none by default
GROUP = "model card"


@dataclass(frozen=True)
class CardOptions:
    """The model card's publication details.

    Raises:
        InvalidParameterError: when a value is not text.
    """

    repo_id: str | None = option(
        None, help="Hub repository the card names (namespace/name)", group=GROUP, metavar="ID", flag="repo"
    )
    license: str | None = option(
        None,
        help=f"license in the card (default: {DEFAULT_LICENSE} for a CLIP run, the CLIP weights' own; for T5 and "
        f"language models {NO_LICENSE}, and the card says none was given)",
        group=GROUP,
        metavar="LICENSE",
    )
    template: str | None = option(None, help="your own Jinja model card template", group=GROUP, metavar="FILE")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class CommitOptions:
    """How ``featcal push`` commits a release (besides :class:`~featcal.hub.options.HubOptions`).

    Raises:
        InvalidParameterError: when a value has the wrong type.
    """

    revision: str | None = option(None, help="branch to commit to (created if missing)", group="Hub", metavar="BRANCH")
    create_pr: bool = option(False, help="open a pull request instead of committing directly", group="Hub")
    commit_message: str | None = option(None, help="commit title", group="Hub", metavar="MSG")

    def __post_init__(self) -> None:
        validate(self)
