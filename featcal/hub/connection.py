"""Whether the Hub may be asked (``HF_HUB_OFFLINE``) and whether it answers."""

from __future__ import annotations

import logging
import os
import socket
from functools import lru_cache
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

OFFLINE_HINT = (
    "Point at a local folder instead (a `save_pretrained` model folder or a parquet dataset repo), "
    "or download it once where the Hub is reachable and set HF_HUB_OFFLINE=1 to use the cache."
)


def is_offline() -> bool:
    """Whether the user asked huggingface_hub to stay offline (``HF_HUB_OFFLINE``).

    Returns:
        True when ``HF_HUB_OFFLINE`` is 1, true, yes or on.
    """
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}


@lru_cache(maxsize=4)
def hub_reachable(endpoint: str | None = None, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds (answer cached).

    Args:
        endpoint: The Hub's URL (default: ``HF_ENDPOINT``, else huggingface.co).
        timeout: Seconds to wait for the connection.

    Returns:
        True when the connection opened.
    """
    from huggingface_hub import constants

    url = urlparse(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False
