"""Passing refusals of the Hub (429, 5xx): a download refused so is asked again, after growing waits."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import parse_ratelimit_headers

logger = logging.getLogger(__name__)

# Answers of the Hub that pass (rate limit, overload, outage): a download refused so is asked again,
# after each of these waits in turn (longer when a 429 says when its limit resets, up to the cap).
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
RETRY_WAITS = (1.0, 2.0, 4.0)
MAX_RETRY_WAIT = 60.0

T = TypeVar("T")


def transient_refusal(exc: BaseException | None) -> HfHubHTTPError | None:
    """The passing refusal of the Hub (429, 5xx, 408) behind ``exc``, following its causes; else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, HfHubHTTPError) and exc.response is not None:
            if exc.response.status_code in TRANSIENT_STATUSES:
                return exc
        exc = exc.__cause__ or exc.__context__
    return None


def asked_wait(refusal: HfHubHTTPError) -> float:
    """The seconds a refusal asks to wait: a 429's rate-limit reset, or ``Retry-After``; 0 when it says nothing."""
    headers = refusal.response.headers
    limit = parse_ratelimit_headers(headers)
    if limit is not None and limit.remaining == 0:
        return limit.reset_in_seconds + 1.0
    retry_after = headers.get("Retry-After", "")
    return float(retry_after) + 1.0 if retry_after.isdigit() else 0.0


def retry_transient(call: Callable[[], T], *, what: str) -> T:
    """``call()``, called again while the Hub answers a passing refusal (429, 5xx), up to ``len(RETRY_WAITS)`` times.

    huggingface_hub retries file downloads itself, but not every request (a repository's information
    is asked once), so the whole call is made again; files it had already downloaded are not fetched
    again. Each retry waits the next of :data:`RETRY_WAITS`, or what the refusal asks for when that is
    longer; a refusal asking for more than :data:`MAX_RETRY_WAIT` is not waited for.

    Args:
        call: The download, without arguments.
        what: What it downloads, for the log (``"base model openai/clip-vit-base-patch32"``).

    Returns:
        What ``call`` returns.

    Raises:
        Exception: Whatever ``call`` raised last, or first when it is no passing refusal.
    """
    for attempt, wait in enumerate(RETRY_WAITS, start=1):
        try:
            return call()
        except Exception as exc:
            refusal = transient_refusal(exc)
            if refusal is None:
                raise
            wait = max(wait, asked_wait(refusal))
            if wait > MAX_RETRY_WAIT:
                raise
            logger.warning(
                "The Hub answered %d for %s; retrying in %.0f s (retry %d of %d)",
                refusal.response.status_code,
                what,
                wait,
                attempt,
                len(RETRY_WAITS),
            )
            time.sleep(wait)
    return call()
