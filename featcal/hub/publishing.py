"""Publishing: the token, the client, the repository's owner, and the Hub's refusals worded.

What both publishers (`featcal push` and `featcal space push`) go through before and while writing to
the Hub. The token is handed to ``huggingface_hub`` and never logged or put in a message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from huggingface_hub import get_token
from huggingface_hub.errors import (
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from featcal.errors import FeatcalError, HubError
from featcal.hub.connection import is_offline

try:
    from httpx2 import TransportError
except ImportError:  # huggingface_hub 1.x talks through httpx
    from httpx import TransportError

if TYPE_CHECKING:
    from huggingface_hub import HfApi

logger = logging.getLogger(__name__)

NOTHING_PUBLISHED = "Nothing was published."
# Files and folders whose name starts with a dot are never listed nor uploaded.
HIDDEN_PATTERNS = [".*", "*/.*"]


def hub_token(token: str | None, *, repo_id: str | None = None) -> str:
    """The token to publish with: ``token``, else HF_TOKEN, else the stored login; never logged.

    Args:
        token: The token given, if any.
        repo_id: The repository it is for (carried by the error).

    Returns:
        The token.

    Raises:
        HubError: No token anywhere.
    """
    token = token or get_token()
    if not token:
        raise HubError(
            repo_id,
            "No Hugging Face token: pass `token`, set HF_TOKEN, or log in once with `hf auth login`. "
            f"{NOTHING_PUBLISHED}",
        )
    return token


def hub_api(token: str | None = None, endpoint: str | None = None, *, repo_id: str | None = None) -> HfApi:
    """An ``HfApi`` client to publish with, once offline mode and the token have been checked.

    Both publishers get their client here, so they refuse offline mode and a missing token alike,
    before anything is staged or sent.

    Args:
        token: The token given, if any (see :func:`hub_token`).
        endpoint: The Hub's URL (default: ``HF_ENDPOINT``, else huggingface.co).
        repo_id: The repository to publish to (carried by the errors).

    Returns:
        The client; nothing has been sent yet.

    Raises:
        HubError: ``HF_HUB_OFFLINE`` is set, or there is no token.
    """
    from huggingface_hub import HfApi

    if is_offline():
        raise HubError(repo_id, f"HF_HUB_OFFLINE is set: unset it to push to the Hub. {NOTHING_PUBLISHED}")
    return HfApi(endpoint=endpoint, token=hub_token(token, repo_id=repo_id))


def check_namespace(repo_id: str, whoami: dict) -> None:
    """Refuse a repository outside the token owner's namespaces, and read-only tokens.

    Args:
        repo_id: The repository to publish to.
        whoami: The Hub's ``whoami-v2`` answer for the token.

    Raises:
        HubError: The namespace is neither the token owner's nor one of their organisations', or the
            token is read-only.
    """
    namespace, _, name = repo_id.partition("/")
    user = whoami.get("name")
    orgs = [org.get("name") for org in whoami.get("orgs") or []]
    if namespace != user and namespace not in orgs:
        owned = ", ".join([user or "?", *orgs])
        raise HubError(
            repo_id,
            f"The repository {repo_id} belongs to someone else: the token is {user!r}'s, who can push to "
            f"{owned}. Push to {user}/{name} instead (`repo_id`), or use a token of {namespace!r}. "
            f"{NOTHING_PUBLISHED}",
        )
    access = (whoami.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise HubError(
            repo_id,
            f"The token is read-only: create a token with write access at https://huggingface.co/settings/tokens "
            f"to push to {repo_id}. {NOTHING_PUBLISHED}",
        )


@contextmanager
def hub_errors(repo_id: str, endpoint: str) -> Iterator[None]:
    """Turn huggingface_hub and network errors raised inside the block into :class:`HubError`.

    Args:
        repo_id: The repository the block writes to (carried by the errors).
        endpoint: The Hub's URL, for the message when it cannot be reached.

    Yields:
        Nothing; featcal's own errors pass through unchanged.

    Raises:
        HubError: With the HTTP ``status`` of the refusal when there was one (401 rejected token,
            403 no write access, 404 repository not visible, ...).
    """
    try:
        yield
    except FeatcalError:
        raise
    except OfflineModeIsEnabled:
        raise HubError(repo_id, f"HF_HUB_OFFLINE is set: unset it to push to the Hub. {NOTHING_PUBLISHED}") from None
    except TransportError as exc:
        raise HubError(
            repo_id,
            f"Cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc}). Check the network or `endpoint`.",
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if isinstance(exc, RepositoryNotFoundError):
            raise HubError(
                repo_id,
                f"The Hub does not let this token see {repo_id}: check the id and that the token may write to it.",
                status=status,
            ) from None
        detail = exc.server_message or str(exc).splitlines()[0]
        if status == 401:
            message = (
                f"The Hub rejected the token (401: {detail}): log in again with `hf auth login` or pass a valid "
                "`token`."
            )
        elif status == 403:
            message = (
                f"The token cannot write to {repo_id} (403: {detail}): use a token with write access to "
                f"{repo_id.split('/')[0]}."
            )
        else:
            message = f"The Hub refused the push to {repo_id} ({status}: {detail})."
        raise HubError(repo_id, message, status=status) from None
    except ValueError as exc:  # e.g. README.md metadata rejected by /api/validate-yaml
        raise HubError(repo_id, f"The Hub refused the push to {repo_id}: {exc}") from None


@contextmanager
def publishing(api: HfApi, repo_id: str) -> Iterator[HfApi]:
    """Check the token may write to ``repo_id`` (``whoami``), then run the block under :func:`hub_errors`.

    Args:
        api: A client from :func:`hub_api`.
        repo_id: The repository to publish to.

    Yields:
        ``api``.

    Raises:
        HubError: The token may not write to ``repo_id``, or the Hub refused a request of the block.
    """
    with hub_errors(repo_id, api.endpoint):
        check_namespace(repo_id, api.whoami())
        yield api
