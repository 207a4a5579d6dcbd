"""The one layer between featcal and the Hugging Face Hub, a module per job: references (:mod:`.refs`),
offline mode and reachability (:mod:`.connection`), retries of passing refusals (:mod:`.retries`),
downloads (:mod:`.downloads`), publishing (:mod:`.publishing`) and verification (:mod:`.verification`).

Errors are typed and carry the offending value (:class:`~featcal.errors.HubError` its ``repo_id`` and
HTTP ``status``, :class:`~featcal.errors.InvalidParameterError` its ``name`` and ``value``); messages
name parameters between backticks (pass `token`), never command-line flags. Names are imported on
first use from the module that defines them.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    **dict.fromkeys(("LOCAL_PREFIXES", "local_path", "is_hub_id", "check_repo_id"), "featcal.hub.refs"),
    **dict.fromkeys(("OFFLINE_HINT", "is_offline", "hub_reachable"), "featcal.hub.connection"),
    **dict.fromkeys(
        ("TRANSIENT_STATUSES", "RETRY_WAITS", "MAX_RETRY_WAIT", "transient_refusal", "retry_transient"),
        "featcal.hub.retries",
    ),
    **dict.fromkeys(
        ("MODEL_FILE_PATTERNS", "gated_repo_message", "download_failure", "resolve_model_folder"),
        "featcal.hub.downloads",
    ),
    **dict.fromkeys(
        ("NOTHING_PUBLISHED", "HIDDEN_PATTERNS", "hub_token", "hub_api", "check_namespace", "hub_errors", "publishing"),
        "featcal.hub.publishing",
    ),
    **dict.fromkeys(("HubFile", "local_files", "hub_files", "verify_hub_files"), "featcal.hub.verification"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
