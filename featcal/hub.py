"""Hub access shared by `featcal push` and `featcal space push`: token, ownership, error messages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from huggingface_hub import get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

from featcal.errors import FeatcalError

try:
    from httpx2 import TransportError
except ImportError:  # huggingface_hub 1.x talks through httpx
    from httpx import TransportError

NOTHING_PUBLISHED = "Nothing was published."


def hub_token(token: str | None) -> str:
    """The token from the argument, HF_TOKEN or the stored login; never logged."""
    token = token or get_token()
    if not token:
        raise FeatcalError(
            "No Hugging Face token: pass --token, set HF_TOKEN, or log in once with `hf auth login`. "
            f"{NOTHING_PUBLISHED}"
        )
    return token


def check_namespace(repo_id: str, whoami: dict) -> None:
    """Refuse a repository outside the token owner's namespaces, and read-only tokens."""
    namespace = repo_id.split("/")[0]
    user = whoami.get("name")
    orgs = [org.get("name") for org in whoami.get("orgs") or []]
    if namespace != user and namespace not in orgs:
        owned = ", ".join([user or "?", *orgs])
        raise FeatcalError(
            f"The repository {repo_id} belongs to someone else: the token is {user!r}'s, who can push to "
            f"{owned}. Use --repo {user}/{repo_id.split('/')[1]}, or a token of {namespace!r}. {NOTHING_PUBLISHED}"
        )
    access = (whoami.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise FeatcalError(
            f"The token is read-only: create a token with write access at https://huggingface.co/settings/tokens "
            f"to push to {repo_id}. {NOTHING_PUBLISHED}"
        )


@contextmanager
def hub_errors(repo_id: str, endpoint: str) -> Iterator[None]:
    """Turn huggingface_hub and network errors into FeatcalErrors that say what to do."""
    try:
        yield
    except OfflineModeIsEnabled:
        raise FeatcalError(f"HF_HUB_OFFLINE is set: unset it to push to the Hub. {NOTHING_PUBLISHED}") from None
    except TransportError as exc:
        raise FeatcalError(
            f"Cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc}). Check the network or --endpoint."
        ) from None
    except RepositoryNotFoundError:
        raise FeatcalError(
            f"The Hub does not let this token see {repo_id}: check the id and that the token may write to it."
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        detail = exc.server_message or str(exc).splitlines()[0]
        if status == 401:
            raise FeatcalError(
                f"The Hub rejected the token (401: {detail}): log in again with `hf auth login` or pass a valid "
                "--token."
            ) from None
        if status == 403:
            raise FeatcalError(
                f"The token cannot write to {repo_id} (403: {detail}): use a token with write access to "
                f"{repo_id.split('/')[0]}."
            ) from None
        raise FeatcalError(f"The Hub refused the push to {repo_id} ({status}: {detail}).") from None
    except ValueError as exc:  # e.g. README.md metadata rejected by /api/validate-yaml
        raise FeatcalError(f"The Hub refused the push to {repo_id}: {exc}") from None
