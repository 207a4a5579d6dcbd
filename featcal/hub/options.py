"""The options every publisher takes (``featcal push``, ``featcal space push``): one definition, one set of flags.

This module imports nothing of the Hub's, so a parser can offer the flags without loading huggingface_hub.
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal.options import option, validate

GROUP = "Hub"


@dataclass(frozen=True)
class HubOptions:
    """Where and how to publish.

    Raises:
        InvalidParameterError: when a value has the wrong type.
    """

    repo_id: str | None = option(None, help="Hub repository, namespace/name", group=GROUP, metavar="ID", flag="repo")
    private: bool = option(False, help="create the repository private (if it is new)", group=GROUP)
    token: str | None = option(
        None, help="Hub token (default: HF_TOKEN, then the stored login); never printed", group=GROUP, metavar="TOKEN"
    )
    dry_run: bool = option(False, help="list what would be uploaded; do not contact the Hub", group=GROUP)
    endpoint: str | None = option(
        None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)", group=GROUP, metavar="URL"
    )

    def __post_init__(self) -> None:
        validate(self)
